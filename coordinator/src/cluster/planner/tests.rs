//! The planner against hand-computed splits, budgets and predictions.

use super::*;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// `n` equal layers of `w` weight bytes and `kv` KV bytes, untied 8 MiB head and embedding.
fn model(n: usize, w: u64, kv: u64) -> ModelCost {
    ModelCost {
        n_layer: n,
        layer_weight_bytes: vec![w; n],
        layer_active_bytes: Vec::new(),
        layer_kv_bytes: vec![kv; n],
        head_bytes: 8 * MIB,
        embedding_bytes: 8 * MIB,
        tied_head: false,
        hidden_bytes: 2304,
        logits_bytes_f16: 2 * 49152,
        slots: 1,
        kv_source: Vec::new(),
        experts: None,
    }
}

fn coord() -> CoordinatorInput {
    CoordinatorInput {
        memory_budget: GIB,
        bytes_per_s: 1e9,
    }
}

fn stage(name: &str, budget: u64, speed: f64) -> StageInput {
    StageInput {
        name: name.to_string(),
        address: format!("{name}:7701"),
        local: false,
        memory_budget: budget,
        scratch_bytes: 0,
        bytes_per_s: speed,
        link_rtt_s: 0.0002,
        pinned: None,
    }
}

fn pinned(mut s: StageInput, r: Range<usize>) -> StageInput {
    s.pinned = Some(r);
    s
}

fn counts(p: &Plan) -> Vec<usize> {
    p.stages.iter().map(|s| s.layers.len()).collect()
}

/// Ranges are consecutive, start at 0, end at n, none empty.
fn assert_covers(p: &Plan, n: usize) {
    let mut next = 0;
    for s in &p.stages {
        assert_eq!(s.layers.start, next, "{p}");
        assert!(!s.layers.is_empty(), "{p}");
        next = s.layers.end;
    }
    assert_eq!(next, n, "{p}");
}

#[test]
fn homogeneous_even_split() {
    let m = model(30, 4 * MIB, MIB);
    let p = plan(&m, &coord(), &[stage("a", GIB, 1e9), stage("b", GIB, 1e9)]).unwrap();
    assert_eq!(counts(&p), vec![15, 15]);
    assert_eq!(p.stages[0].layers, 0..15);
    assert_eq!(p.head, HeadPlace::Coordinator);
    let p = plan(
        &m,
        &coord(),
        &[
            stage("a", GIB, 1e9),
            stage("b", GIB, 1e9),
            stage("c", GIB, 1e9),
        ],
    )
    .unwrap();
    assert_eq!(counts(&p), vec![10, 10, 10]);
    assert_covers(&p, 30);
    assert_eq!(p.stages[1].weight_bytes, 40 * MIB);
    assert_eq!(p.stages[1].kv_bytes, 10 * MIB);
    assert!(p.stages.iter().all(|s| !s.holds_head));
}

#[test]
fn uneven_count_is_deterministic() {
    let m = model(10, MIB, 0);
    let s = [
        stage("a", GIB, 1e9),
        stage("b", GIB, 1e9),
        stage("c", GIB, 1e9),
    ];
    let p = plan(&m, &coord(), &s).unwrap();
    let mut c = counts(&p);
    c.sort_unstable();
    assert_eq!(c, vec![3, 3, 4]);
    assert_eq!(plan(&m, &coord(), &s).unwrap(), p);
}

#[test]
fn faster_node_gets_more_layers() {
    let m = model(30, 4 * MIB, MIB);
    let p = plan(
        &m,
        &coord(),
        &[stage("fast", GIB, 2e9), stage("slow", GIB, 1e9)],
    )
    .unwrap();
    assert_eq!(counts(&p), vec![20, 10]);
    // Balanced: both stages take the same time.
    assert!(
        (p.stages[0].compute_s - p.stages[1].compute_s).abs() < 1e-12,
        "{p}"
    );
    let p = plan(
        &m,
        &coord(),
        &[
            stage("a", GIB, 1e9),
            stage("b", GIB, 3e9),
            stage("c", GIB, 2e9),
        ],
    )
    .unwrap();
    assert_eq!(counts(&p), vec![5, 15, 10]);
}

#[test]
fn memory_cap_water_fills() {
    let m = model(30, 4 * MIB, MIB); // 5 MiB per layer
    let s = [
        stage("a", GIB, 1e9),
        stage("small", 26 * MIB, 1e9),
        stage("c", GIB, 1e9),
    ];
    let p = plan(&m, &coord(), &s).unwrap();
    assert_eq!(p.stages[1].layers.len(), 5, "{p}");
    assert!(p.stages[1].weight_bytes + p.stages[1].kv_bytes <= 26 * MIB);
    let c = counts(&p);
    assert_eq!(c[0] + c[2], 25);
    assert!(c[0].abs_diff(c[2]) <= 1, "{p}");
    assert_covers(&p, 30);
    // The rest goes in proportion to speed.
    let s = [
        stage("a", GIB, 2e9),
        stage("small", 26 * MIB, 1e9),
        stage("c", GIB, 1e9),
    ];
    let p = plan(&m, &coord(), &s).unwrap();
    assert_eq!(counts(&p), vec![17, 5, 8], "{p}");
}

#[test]
fn layers_of_different_sizes() {
    // Gemma-like: every sixth layer has a larger KV cache; weights differ too.
    let mut m = model(12, 4 * MIB, MIB);
    m.layer_weight_bytes[0] = 12 * MIB;
    m.layer_kv_bytes[5] = 16 * MIB;
    let p = plan(&m, &coord(), &[stage("a", GIB, 1e9), stage("b", GIB, 1e9)]).unwrap();
    assert_covers(&p, 12);
    // Weights 52 MiB in all; the even split of weights puts the cut after layer 4 (28/24 MiB).
    assert_eq!(p.stages[0].layers, 0..5, "{p}");
}

#[test]
fn impossible_fit() {
    let m = model(30, 40 * MIB, 10 * MIB); // 1500 MiB in all
    let e = plan(
        &m,
        &coord(),
        &[stage("a", 500 * MIB, 1e9), stage("b", 500 * MIB, 1e9)],
    )
    .unwrap_err();
    match &e {
        PlanError::DoesNotFit {
            needed, available, ..
        } => {
            assert_eq!(*needed, 1500 * MIB);
            assert_eq!(*available, 1000 * MIB);
        }
        other => panic!("{other:?}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("1.46 GiB") && msg.contains("1000.0 MiB") && msg.contains("500.0 MiB short"),
        "{msg}"
    );
    assert!(msg.contains("\"a\"") && msg.contains("\"b\""), "{msg}");
}

#[test]
fn fragmented_fit_is_explained() {
    // 3 layers of 10 MiB; budgets 15 + 15 + 5: 35 MiB ≥ 30 but c cannot hold one layer.
    let m = model(3, 10 * MIB, 0);
    let e = plan(
        &m,
        &coord(),
        &[
            stage("a", 15 * MIB, 1e9),
            stage("b", 15 * MIB, 1e9),
            stage("c", 5 * MIB, 1e9),
        ],
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, PlanError::DoesNotFit { .. })
            && msg.contains("\"c\"")
            && msg.contains("one layer"),
        "{msg}"
    );
    // 4 layers of 10 MiB; budgets 15 + 25: 40 MiB ≥ 40 but a holds 1, b holds 2 → 3 < 4.
    let m = model(4, 10 * MIB, 0);
    let e = plan(
        &m,
        &coord(),
        &[stage("a", 15 * MIB, 1e9), stage("b", 25 * MIB, 1e9)],
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("consecutive ranges"), "{msg}");
}

#[test]
fn head_moves_to_last_node() {
    let m = model(30, 4 * MIB, MIB);
    let small = CoordinatorInput {
        memory_budget: 12 * MIB,
        bytes_per_s: 1e9,
    };
    let p = plan(&m, &small, &[stage("a", GIB, 1e9), stage("b", GIB, 1e9)]).unwrap();
    assert_eq!(p.head, HeadPlace::LastNode);
    assert_eq!(p.coordinator_s, 0.0);
    assert!(p.stages[1].holds_head && !p.stages[0].holds_head);
    // The head's 8 MiB is worth two 4 MiB layers: b takes two fewer.
    assert_eq!(counts(&p), vec![16, 14], "{p}");
    assert_eq!(p.stages[1].weight_bytes, 14 * 4 * MIB + 8 * MIB);
    assert!(p.to_string().contains("last stage \"b\""));
    // The embedding alone does not fit: error.
    let tiny = CoordinatorInput {
        memory_budget: 4 * MIB,
        bytes_per_s: 1e9,
    };
    let e = plan(&m, &tiny, &[stage("a", GIB, 1e9)]).unwrap_err();
    assert!(e.to_string().contains("embedding"), "{e}");
    // Tied: head and embedding counted once, so 8 MiB is enough.
    let mut tied = m.clone();
    tied.tied_head = true;
    let eight = CoordinatorInput {
        memory_budget: 8 * MIB,
        bytes_per_s: 1e9,
    };
    assert_eq!(
        plan(&tied, &eight, &[stage("a", GIB, 1e9)]).unwrap().head,
        HeadPlace::Coordinator
    );
}

#[test]
fn pins_are_honoured() {
    let m = model(30, 4 * MIB, MIB);
    let s = [
        pinned(stage("a", GIB, 1e9), 0..5),
        stage("b", GIB, 1e9),
        stage("c", GIB, 1e9),
    ];
    let p = plan(&m, &coord(), &s).unwrap();
    assert_eq!(p.stages[0].layers, 0..5);
    assert_eq!(counts(&p)[1..], [12, 13]);
    let s = [
        stage("a", GIB, 1e9),
        pinned(stage("b", GIB, 1e9), 10..20),
        stage("c", GIB, 1e9),
    ];
    let p = plan(&m, &coord(), &s).unwrap();
    assert_eq!(
        p.stages
            .iter()
            .map(|s| s.layers.clone())
            .collect::<Vec<_>>(),
        vec![0..10, 10..20, 20..30]
    );
    let s = [
        pinned(stage("a", GIB, 1e9), 0..7),
        pinned(stage("b", GIB, 1e9), 7..30),
    ];
    let p = plan(&m, &coord(), &s).unwrap();
    assert_eq!(counts(&p), vec![7, 23]);
}

#[test]
fn bad_pins_rejected() {
    let m = model(30, 4 * MIB, MIB);
    let cases: Vec<(Vec<StageInput>, &str)> = vec![
        (
            vec![
                pinned(stage("a", GIB, 1e9), 0..5),
                pinned(stage("b", GIB, 1e9), 4..30),
            ],
            "overlap",
        ),
        (
            vec![
                pinned(stage("a", GIB, 1e9), 0..5),
                pinned(stage("b", GIB, 1e9), 6..30),
            ],
            "leaving 1 layer",
        ),
        (
            vec![
                pinned(stage("a", GIB, 1e9), 0..5),
                pinned(stage("b", GIB, 1e9), 5..29),
            ],
            "extend the last pin",
        ),
        (vec![pinned(stage("a", GIB, 1e9), 0..31)], "has 30 layers"),
        (vec![pinned(stage("a", GIB, 1e9), 1..30)], "leaving 1 layer"),
        (
            vec![
                pinned(stage("a", GIB, 1e9), 0..5),
                stage("b", GIB, 1e9),
                pinned(stage("c", GIB, 1e9), 5..30),
            ],
            "leaving 0 layer",
        ),
        (
            vec![pinned(stage("a", GIB, 1e9), 0..30), stage("b", GIB, 1e9)],
            "unpinned",
        ),
        (
            vec![
                stage("a", GIB, 1e9),
                pinned(stage("b", GIB, 1e9), 10..20),
                pinned(stage("c", GIB, 1e9), 0..10),
            ],
            "come before",
        ),
    ];
    for (s, want) in cases {
        let e = plan(&m, &coord(), &s).unwrap_err();
        assert!(matches!(e, PlanError::BadPin { .. }), "{e:?}");
        assert!(e.to_string().contains(want), "{want:?}: {e}");
    }
    // A pin that does not fit its stage's memory.
    let s = [
        pinned(stage("a", 10 * MIB, 1e9), 0..5),
        stage("b", GIB, 1e9),
    ];
    let e = plan(&m, &coord(), &s).unwrap_err();
    assert!(
        matches!(e, PlanError::DoesNotFit { .. }) && e.to_string().contains("pinned to layers 0-4"),
        "{e}"
    );
}

#[test]
fn bad_input_rejected() {
    let m = model(2, MIB, 0);
    assert!(matches!(
        plan(&m, &coord(), &[]),
        Err(PlanError::BadInput { .. })
    ));
    let s = [
        stage("a", GIB, 1e9),
        stage("b", GIB, 1e9),
        stage("c", GIB, 1e9),
    ];
    let e = plan(&m, &coord(), &s).unwrap_err();
    assert!(e.to_string().contains("remove 1 node"), "{e}");
    let mut bad = model(3, MIB, 0);
    bad.layer_kv_bytes.pop();
    assert!(matches!(
        plan(&bad, &coord(), &s),
        Err(PlanError::BadInput { .. })
    ));
}

#[test]
fn local_stage() {
    let m = model(30, 4 * MIB, MIB);
    let mut master = stage("master", GIB, 1e9);
    master.local = true;
    master.address = "local".to_string();
    master.link_rtt_s = 0.0;
    let s = [master, stage("b", GIB, 1e9)];
    let p = plan(&m, &coord(), &s).unwrap();
    assert_eq!(counts(&p), vec![15, 15]);
    assert!(p.stages[0].local);
    // coordinator → master: 0; master → b: b's half rtt; b → coordinator: half rtt.
    assert!((p.link_s - 0.0002).abs() < 1e-15, "{}", p.link_s);
    // Hidden states cross the network twice: master → b, b → coordinator.
    assert!(
        (p.transfer_s - 2.0 * 2304.0 / 125e6).abs() < 1e-15,
        "{}",
        p.transfer_s
    );
    assert!(p.to_string().contains("local"));
}

#[test]
fn prediction_arithmetic() {
    // 4 layers of 1e6 bytes, two stages at 1e9 B/s: 2 ms each. Head 1e6 B at 1e9: 1 ms.
    // Links (rtt 1 ms each): 0.5 + (0.5 + 0.5) / 2 + 0.5 = 1.5 ms.
    // Wire: three hops of 1250 B at 125e6 B/s = 0.03 ms. Total 6.53 ms.
    let m = ModelCost {
        n_layer: 4,
        layer_weight_bytes: vec![1_000_000; 4],
        layer_active_bytes: Vec::new(),
        layer_kv_bytes: vec![0; 4],
        head_bytes: 1_000_000,
        embedding_bytes: 1_000_000,
        tied_head: false,
        hidden_bytes: 1250,
        logits_bytes_f16: 250_000,
        slots: 1,
        kv_source: Vec::new(),
        experts: None,
    };
    let mut a = stage("a", GIB, 1e9);
    a.link_rtt_s = 0.001;
    let mut b = stage("b", GIB, 1e9);
    b.link_rtt_s = 0.001;
    let p = plan(&m, &coord(), &[a.clone(), b.clone()]).unwrap();
    let close = |x: f64, y: f64| (x - y).abs() < 1e-12;
    assert!(close(p.stages[0].compute_s, 0.002) && close(p.stages[1].compute_s, 0.002));
    assert!(close(p.coordinator_s, 0.001));
    assert!(close(p.link_s, 0.0015));
    assert!(close(p.transfer_s, 0.00003));
    assert!(
        close(p.predicted_s_per_token, 0.00653),
        "{}",
        p.predicted_s_per_token
    );
    assert!((p.predicted_tokens_per_s - 1.0 / 0.00653).abs() < 1e-6);
    // Five layers and no room for the head on the coordinator: b holds the head, worth one
    // layer, so a takes 3 layers (3 ms) and b 2 layers + head (3 ms). The wire carries one
    // hidden state twice and the f16 logits (250 kB, 2 ms) once: 2.02 ms. Total 9.52 ms.
    let mut m5 = m.clone();
    m5.n_layer = 5;
    m5.layer_weight_bytes = vec![1_000_000; 5];
    m5.layer_kv_bytes = vec![0; 5];
    let small = CoordinatorInput {
        memory_budget: 1_500_000,
        bytes_per_s: 1e9,
    };
    let p = plan(&m5, &small, &[a, b]).unwrap();
    assert_eq!(p.head, HeadPlace::LastNode);
    assert_eq!(counts(&p), vec![3, 2]);
    assert!(close(p.stages[0].compute_s, 0.003) && close(p.stages[1].compute_s, 0.003));
    assert_eq!(p.stages[1].weight_bytes, 3_000_000);
    assert!(close(p.coordinator_s, 0.0));
    assert!(close(p.transfer_s, 0.00202), "{}", p.transfer_s);
    assert!(
        close(p.predicted_s_per_token, 0.00952),
        "{}",
        p.predicted_s_per_token
    );
    // Mixture-of-experts layers of 16 MB of which a token reads 1 MB: each stage's compute is
    // its active bytes (2 ms, as the dense 1 MB layers), its memory the whole layers.
    let mut moe = m.clone();
    moe.layer_weight_bytes = vec![16_000_000; 4];
    moe.layer_active_bytes = vec![1_000_000; 4];
    let p = plan(
        &moe,
        &coord(),
        &[stage("a", GIB, 1e9), stage("b", GIB, 1e9)],
    )
    .unwrap();
    assert!(close(p.stages[0].compute_s, 0.002) && close(p.stages[1].compute_s, 0.002));
    assert_eq!(p.stages[0].weight_bytes, 32_000_000);
    // Read-per-token sizes for the wrong number of layers are refused by name.
    moe.layer_active_bytes.pop();
    let e = plan(&moe, &coord(), &[stage("a", GIB, 1e9)]).unwrap_err();
    assert!(e.to_string().contains("weights read per token"), "{e}");
}

#[test]
fn bad_speeds_are_guarded() {
    let m = model(30, 4 * MIB, MIB);
    let p = plan(
        &m,
        &coord(),
        &[
            stage("a", GIB, 1e9),
            stage("zero", GIB, 0.0),
            stage("nan", GIB, f64::NAN),
        ],
    )
    .unwrap();
    assert_eq!(counts(&p), vec![28, 1, 1]);
    assert!(p.predicted_tokens_per_s.is_finite() && p.predicted_tokens_per_s > 0.0);
}

#[test]
fn display_shows_ranges() {
    let m = model(30, 4 * MIB, MIB);
    let p = plan(&m, &coord(), &[stage("a", GIB, 1e9), stage("b", GIB, 1e9)]).unwrap();
    let text = p.to_string();
    assert!(text.contains("0-14") && text.contains("15-29"), "{text}");
    assert!(
        text.contains("a:7701")
            && text.contains("tokens/s")
            && text.contains("head: on the coordinator"),
        "{text}"
    );
    assert!(
        text.lines().next().is_some_and(|l| l.starts_with("stage")),
        "{text}"
    );
}

#[test]
fn bytes_format() {
    assert_eq!(format_bytes(3 * GIB / 2), "1.50 GiB");
    assert_eq!(format_bytes(312 * MIB + 400 * 1024), "312.4 MiB");
    assert_eq!(format_bytes(12 * 1024), "12.0 KiB");
    assert_eq!(format_bytes(512), "512 B");
    assert_eq!(format_bytes(2 << 40), "2.00 TiB");
    assert_eq!(format_layers(&(0..9)), "0-8");
    assert_eq!(format_layers(&(5..6)), "5-5");
}

#[test]
fn headroom_is_an_eighth_within_bounds() {
    assert_eq!(headroom(0), MIN_HEADROOM);
    assert_eq!(headroom(200 * MIB), MIN_HEADROOM);
    assert_eq!(headroom(512 * MIB), 64 * MIB);
    assert_eq!(headroom(8 * GIB), 256 * MIB);
    assert_eq!(headroom(64 * GIB), HEADROOM);
}

#[test]
fn every_slot_has_its_kv_cache() {
    // 30 layers of 3 MiB weights and 3 MiB KV per slot; two nodes of 300 MiB. One slot: 6 MiB
    // a layer, 15 each. Eight slots (serving --parallel 8): 27 MiB a layer, 11 fit a node, so
    // 30 layers do not fit two (the plan used to count one slot and load eight).
    let mut m = model(30, 3 * MIB, 3 * MIB);
    let two = [stage("a", 300 * MIB, 1e9), stage("b", 300 * MIB, 1e9)];
    let p = plan(&m, &coord(), &two).unwrap();
    assert_eq!(counts(&p), vec![15, 15]);
    assert_eq!(p.stages[0].kv_bytes, 45 * MIB);
    m.slots = 8;
    let e = plan(&m, &coord(), &two).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("for 8 slots") && msg.contains("fewer --parallel"),
        "{msg}"
    );
    // Each node: its budget, about how many layers it holds, and what one more would need.
    assert!(
        msg.contains(
            "\"a\" budget 300.0 MiB (about 11 layers; 12 layers need 324.0 MiB (weights 36.0 \
             MiB + KV for 8 slots 288.0 MiB + scratch 0 B))"
        ),
        "{msg}"
    );
    match e {
        PlanError::DoesNotFit {
            needed, available, ..
        } => {
            assert_eq!(needed, 30 * 27 * MIB);
            assert_eq!(available, 600 * MIB);
        }
        other => panic!("{other:?}"),
    }
    // Three nodes hold 33 such layers: 10 + 10 + 10, each with 8 caches.
    let three = [
        stage("a", 300 * MIB, 1e9),
        stage("b", 300 * MIB, 1e9),
        stage("c", 300 * MIB, 1e9),
    ];
    let p = plan(&m, &coord(), &three).unwrap();
    assert_eq!(counts(&p), vec![10, 10, 10]);
    assert_eq!(p.slots, 8);
    for s in &p.stages {
        assert_eq!(s.kv_bytes, 10 * 24 * MIB);
        assert!(s.weight_bytes + s.kv_bytes + s.scratch_bytes <= s.memory_budget);
    }
    assert!(p.to_string().contains("KV: 8 slots per stage"), "{p}");
    // 0 slots is taken as 1.
    m.slots = 0;
    assert_eq!(counts(&plan(&m, &coord(), &two).unwrap()), vec![15, 15]);
}

#[test]
fn scratch_is_held_whatever_the_layers() {
    // 26 layers of 6 MiB (weights + KV), two nodes of 100 MiB: a's runner needs 40 MiB of
    // scratch, so a holds 10 layers and b 16, however fast a is.
    let m = model(26, 3 * MIB, 3 * MIB);
    let mut a = stage("a", 100 * MIB, 4e9);
    a.scratch_bytes = 40 * MIB;
    let b = stage("b", 100 * MIB, 1e9);
    let p = plan(&m, &coord(), &[a.clone(), b.clone()]).unwrap();
    assert_eq!(counts(&p), vec![10, 16], "{p}");
    assert_eq!(p.stages[0].scratch_bytes, 40 * MIB);
    assert_eq!(p.stages[1].scratch_bytes, 0);
    assert!(p.to_string().contains("scratch MiB"), "{p}");
    // With 96 MiB of scratch, a cannot hold one layer: the error names it, what it needs, and
    // its budget.
    a.scratch_bytes = 96 * MIB;
    let msg = plan(&m, &coord(), &[a.clone(), b.clone()])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("Stage \"a\" cannot hold even one layer")
            && msg.contains("needs 102.0 MiB (weights 3.0 MiB + KV 3.0 MiB + scratch 96.0 MiB)")
            && msg.contains("budget is 100.0 MiB"),
        "{msg}"
    );
    // A pinned stage's message has the parts too.
    a.scratch_bytes = 40 * MIB;
    let msg = plan(&m, &coord(), &[pinned(a, 0..11), pinned(b, 11..26)])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("need 106.0 MiB (weights 33.0 MiB + KV 33.0 MiB + scratch 40.0 MiB)"),
        "{msg}"
    );
}

#[test]
fn a_shared_kv_layer_stays_with_its_source() {
    // 6 equal layers over 2 equal stages would cut 0..3 | 3..6; layer 4 reads layer 2's cache,
    // so the cut moves to 2..6 or 0..5 boundaries that keep them together.
    let mut m = model(6, 100 * MIB, 0);
    m.kv_source = vec![None, None, None, None, Some(2), Some(3)];
    let p = plan(&m, &coord(), &[stage("a", GIB, 1e9), stage("b", GIB, 1e9)]).unwrap();
    let r: Vec<_> = p.stages.iter().map(|s| s.layers.clone()).collect();
    assert!(r == vec![0..2, 2..6], "{r:?}");
    // A pin that would separate them is refused.
    let mut a = stage("a", GIB, 1e9);
    a.pinned = Some(0..3);
    let err = plan(&m, &coord(), &[a, stage("b", GIB, 1e9)]).unwrap_err();
    assert!(err.to_string().contains("shared-KV layer"), "{err}");
}
