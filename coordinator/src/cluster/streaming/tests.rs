//! The ring's timing model follows its definition, and prices a node alone exactly as the
//! node's streamer does.

use super::{simulate, SimNode, SimRing};
use ringllm_model::stream::{node_s_per_token, SimLayer};

fn node(depth: usize, rate: f64) -> SimNode {
    SimNode {
        read_bytes_per_s: rate,
        depth,
    }
}

fn layer(compute_s: f64, streamed: Option<u64>) -> SimLayer {
    SimLayer {
        compute_s,
        streamed_bytes: streamed,
    }
}

#[test]
fn the_timing_model_follows_its_definition() {
    // Resident only: compute plus hops plus the fixed time.
    let ring = SimRing {
        nodes: vec![node(1, 1.0), node(1, 1.0)],
        visits: vec![
            (0, vec![layer(0.5, None), layer(0.5, None)]),
            (1, vec![layer(1.0, None)]),
        ],
        hop_s: 0.25,
        fixed_s: 0.5,
    };
    // 2 compute + 3 hops (into each visit and back) + 0.5.
    assert!((simulate(&ring) - 3.25).abs() < 1e-9, "{}", simulate(&ring));
    // One node, everything streamed, I/O bound: 4 layers of 1 s to read, 0.1 s to compute.
    // With the pool wide enough the reader never waits for a buffer, so a token takes the
    // reading time of its layers: 4 s.
    let io_bound = |depth| SimRing {
        nodes: vec![node(depth, 1.0)],
        visits: vec![(0, (0..4).map(|_| layer(0.1, Some(1))).collect())],
        hop_s: 0.0,
        fixed_s: 0.0,
    };
    assert!((simulate(&io_bound(4)) - 4.0).abs() < 1e-9);
    // Depth 1 (two buffers): the same, the read of layer i+2 waits for layer i's compute,
    // which ends long before layer i+1's read does.
    assert!((simulate(&io_bound(1)) - 4.0).abs() < 1e-9);
    // Compute bound: reads hide behind compute; 4 × 1 s compute, the first read (0.1 s) of
    // each token overlapped with the previous token's end at depth ≥ 1.
    let cpu_bound = SimRing {
        nodes: vec![node(1, 10.0)],
        visits: vec![(0, (0..4).map(|_| layer(1.0, Some(1))).collect())],
        hop_s: 0.0,
        fixed_s: 0.0,
    };
    assert!(
        (simulate(&cpu_bound) - 4.0).abs() < 1e-9,
        "{}",
        simulate(&cpu_bound)
    );
    // Idle time elsewhere (another node's compute) is used for reading ahead, up to the pool.
    let with_gap = |depth| SimRing {
        nodes: vec![node(depth, 1.0)],
        visits: vec![(0, (0..4).map(|_| layer(0.0, Some(1))).collect())],
        hop_s: 0.0,
        fixed_s: 2.0,
    };
    // Depth 3 (4 buffers): the whole next token is read during the 2 s gap... up to 2 layers
    // in 2 s, so each token waits 2 s of reading plus the 2 s gap: period 4 s; depth 1 (2
    // buffers) reads 2 during the gap as well: the same.
    assert!(
        (simulate(&with_gap(3)) - 4.0).abs() < 1e-9,
        "{}",
        simulate(&with_gap(3))
    );
    assert!((simulate(&with_gap(1)) - 4.0).abs() < 1e-9);
    // A slower disk makes it slower; a resident layer instead of a streamed one makes it
    // faster.
    let mut slow = io_bound(2);
    slow.nodes[0].read_bytes_per_s = 0.5;
    assert!(simulate(&slow) > simulate(&io_bound(2)));
    let mut part = io_bound(2);
    part.visits[0].1[0].streamed_bytes = None;
    assert!(simulate(&part) < simulate(&io_bound(2)));
}

#[test]
fn a_ring_of_one_node_is_priced_as_the_node_prices_itself() {
    for depth in 1..=4 {
        for (rate, idle) in [(1.0, 0.0), (0.5, 2.0), (10.0, 0.3), (0.0, 1.0)] {
            let layers: Vec<SimLayer> = (0..6)
                .map(|i| layer(0.1 * i as f64, (i % 3 != 0).then_some(1 + i as u64)))
                .collect();
            let ring = SimRing {
                nodes: vec![node(depth, rate)],
                visits: vec![(0, layers.clone())],
                hop_s: 0.0,
                fixed_s: idle,
            };
            assert_eq!(
                simulate(&ring).to_bits(),
                node_s_per_token(&layers, rate, depth, idle).to_bits(),
                "depth {depth} rate {rate} idle {idle}"
            );
        }
    }
}

/// A mixture of experts short of memory: each node keeps its layers without their experts and
/// caches what is left of its budget; the prediction is the compute plus the misses of a
/// uniform router read at the disk rate, computed here by hand. Too little memory for the
/// non-expert weights and the fewest expert buffers is refused by name.
#[test]
fn a_mixture_of_experts_streams_its_experts_in_place() {
    use super::{plan, Choice};
    use crate::cluster::planner::{CoordinatorInput, ExpertCost, ModelCost, StageInput};
    const MIB: u64 = 1 << 20;
    // 8 layers of 100 MiB: 96 MiB of it 32 experts of 3 MiB, 4 picked per token.
    let n = 8;
    let model = ModelCost {
        n_layer: n,
        layer_weight_bytes: vec![100 * MIB; n],
        layer_active_bytes: vec![16 * MIB; n],
        layer_kv_bytes: vec![MIB; n],
        head_bytes: 8 * MIB,
        embedding_bytes: 8 * MIB,
        tied_head: false,
        hidden_bytes: 2048,
        logits_bytes_f16: 2 * 32000,
        slots: 1,
        kv_source: Vec::new(),
        experts: Some(ExpertCost {
            layer_expert_bytes: vec![96 * MIB; n],
            n_expert: 32,
            n_used: 4,
            slot_bytes: 3 * MIB,
            min_slots: 6,
        }),
    };
    let coord = CoordinatorInput {
        memory_budget: 1 << 30,
        bytes_per_s: 1e9,
    };
    let stage = |name: &str, budget: u64| StageInput {
        name: name.to_string(),
        address: format!("{name}:7701"),
        local: false,
        memory_budget: budget,
        scratch_bytes: 0,
        bytes_per_s: 1e9,
        link_rtt_s: 0.0,
        pinned: None,
    };
    // Two nodes of 212 MiB: 4 layers each, 16 MiB resident + 4 MiB KV, 192 MiB = 64 of the
    // 128 experts cached.
    let stages = [stage("a", 212 * MIB), stage("b", 212 * MIB)];
    let p = plan(&model, &coord, &stages, &[500e6, 500e6], Choice::Auto).expect("a plan");
    let c = p.chosen();
    assert_eq!(c.name, "experts streamed in place");
    assert!(
        p.alternatives.iter().any(|a| a.naive),
        "the naive layout is shown beside it"
    );
    let mut s = 0.0;
    for st in &c.stages {
        assert_eq!(st.streamed.len(), 4, "{st:?}");
        assert_eq!(st.resident_bytes, 16 * MIB);
        assert_eq!(st.pool_bytes, 64 * 3 * MIB);
        // 4 layers x 4 picks x 3 MiB, half of them missed.
        let read = 4.0 * 4.0 * 3.0 * MIB as f64 * 0.5;
        assert_eq!(st.streamed_bytes, read as u64);
        s += (4 * 16 * MIB) as f64 / 1e9 + read / 500e6;
    }
    let hop = 2048.0 / crate::cluster::planner::ASSUMED_LINK_BYTES_PER_S;
    s += 3.0 * hop + (8 * MIB) as f64 / 1e9;
    assert!(
        (c.predicted_s_per_token - s).abs() < 1e-9 * s,
        "{} vs {s}",
        c.predicted_s_per_token
    );
    // 30 MiB each: not even the 16 MiB without experts, the KV and six 3 MiB buffers.
    let small = [stage("a", 30 * MIB), stage("b", 30 * MIB)];
    let e = plan(&model, &coord, &small, &[500e6, 500e6], Choice::Auto).unwrap_err();
    assert!(e.to_string().contains("expert buffers"), "{e}");
}
