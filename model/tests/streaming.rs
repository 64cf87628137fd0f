//! Layers streamed from disk: the streamer hands out exactly the file's bytes whatever the
//! read-ahead depth, order or skips, and a model whose layers stream gives the resident
//! model's bits; one node's timing model and the tier split follow their definitions (the
//! ring's timing model is tested beside it, in the coordinator's `cluster::streaming`).

use ringllm_kernels::GgmlType;
use ringllm_model::gguf::GgufFile;
use ringllm_model::stream::{layer_span, node_s_per_token, plan_tiers, SimLayer, Streamer};
use ringllm_model::synth::{synth_model, SynthArch, SynthSpec};
use ringllm_model::{KvType, LoadOptions, Model, Runner};
use std::sync::Arc;

/// A synthetic model written to a real file (so the streamer reads it with O_DIRECT, or
/// through the page cache where the filesystem refuses that), and held in memory too.
fn files(arch: SynthArch, ty: GgmlType, tag: &str) -> (Arc<GgufFile>, Arc<GgufFile>) {
    let bytes = synth_model(&SynthSpec {
        n_layer: 6,
        ..SynthSpec::new(arch, ty, 7)
    })
    .expect("synth");
    let dir =
        std::env::temp_dir().join(format!("ringllm-stream-test-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("m.gguf");
    std::fs::write(&path, &bytes).expect("write the model");
    let on_disk = Arc::new(GgufFile::open(&path).expect("open"));
    let in_memory = Arc::new(GgufFile::from_bytes(bytes).expect("read back"));
    (on_disk, in_memory)
}

#[test]
fn every_layer_comes_back_as_the_file_has_it_at_every_depth_order_and_skip() {
    let (disk, mem) = files(SynthArch::Llama, GgmlType::Q8_0, "bytes");
    let n = Model::open(disk.path().unwrap()).unwrap().hp.n_layer;
    assert!(n >= 3, "the test model needs a few layers");
    let layers: Vec<usize> = (0..n).collect();
    for file in [&disk, &mem] {
        for depth in 1..=4 {
            let st = Streamer::new(file, &layers, depth).expect("streamer");
            let check = |il: usize| {
                let g = st.acquire(il).expect("acquire");
                let span = layer_span(file, il).unwrap();
                assert_eq!(g.file_start, span.range.start);
                assert_eq!(
                    &*g,
                    &file.bytes()[span.range.clone()],
                    "layer {il} depth {depth}"
                );
            };
            // Three passes in order, as tokens do.
            for _ in 0..3 {
                for &il in &layers {
                    check(il);
                }
            }
            assert_eq!(st.stats().restarts, 0, "in-order passes never restart");
            // A pass that skips layer 1 (told before it is needed), then one in order.
            st.skip(1);
            for &il in layers.iter().filter(|&&l| l != 1) {
                check(il);
            }
            for &il in &layers {
                check(il);
            }
            // Out of order: the read-ahead restarts, the bytes are still right.
            check(n - 1);
            check(0);
            check(n - 1);
            let s = st.stats();
            assert!(s.restarts >= 1, "{s:?}");
            assert!(s.layers_read >= 4 * n as u64 - 1, "{s:?}");
        }
    }
}

#[test]
fn a_streamed_model_gives_the_resident_models_bits_at_every_depth() {
    for (arch, ty) in [
        (SynthArch::Llama, GgmlType::Q4_0),
        (SynthArch::Gemma3, GgmlType::Q8_0),
        // Fused Q/K/V and gate/up read as row views of the streamed layer's bytes.
        (SynthArch::Phi3, GgmlType::Q4_K),
    ] {
        let (file, _) = files(arch, ty, arch.name());
        let resident = Arc::new(Model::load(Arc::clone(&file), &LoadOptions::default()).unwrap());
        let n = resident.hp.n_layer;
        let run = |model: Arc<Model>| -> Vec<Vec<f32>> {
            let mut r = Runner::new(model, 1, 8, 32);
            let mut kv = r.new_cache(32, KvType::F32);
            let mut x = Vec::new();
            let mut logits = vec![0f32; r.model.hp.vocab];
            let mut out = Vec::new();
            // A prefill batch, then single tokens.
            r.step(&[1, 5, 9, 2, 7], &mut kv, &mut x, &mut logits)
                .unwrap();
            out.push(logits.clone());
            for t in [3u32, 11, 4, 6] {
                r.step(&[t], &mut kv, &mut x, &mut logits).unwrap();
                out.push(logits.clone());
            }
            out
        };
        let want = run(Arc::clone(&resident));
        // Everything streamed, and a tail streamed behind resident layers, with and without
        // repacking of the resident part.
        let tails: Vec<Vec<usize>> = vec![(0..n).collect(), (n / 2..n).collect()];
        for streamed in &tails {
            for depth in 1..=4 {
                for repack in [false, true] {
                    let st = Arc::new(Streamer::new(&file, streamed, depth).unwrap());
                    let m = Model::load(
                        Arc::clone(&file),
                        &LoadOptions {
                            repack,
                            stream: Some(Arc::clone(&st)),
                            ..LoadOptions::default()
                        },
                    )
                    .unwrap();
                    let got = run(Arc::new(m));
                    assert_eq!(
                        got,
                        want,
                        "{} streamed {streamed:?} depth {depth} repack {repack}",
                        arch.name()
                    );
                    let s = st.stats();
                    // Five passes read every streamed layer (more when read ahead).
                    assert!(s.layers_read >= 5 * streamed.len() as u64, "{s:?}");
                }
            }
        }
    }
}

fn layer(compute_s: f64, streamed: Option<u64>) -> SimLayer {
    SimLayer {
        compute_s,
        streamed_bytes: streamed,
    }
}

#[test]
fn one_nodes_timing_model_follows_its_definition() {
    // Resident only: the compute plus the time spent elsewhere.
    let resident = [layer(0.5, None), layer(0.5, None), layer(1.0, None)];
    let s = node_s_per_token(&resident, 1.0, 1, 0.25);
    assert!((s - 2.25).abs() < 1e-9, "{s}");
    // Everything streamed, I/O bound (4 layers of 1 s to read, 0.1 s to compute): a token
    // takes the reading time of its layers, at depth 4 as at depth 1.
    let io_bound: Vec<SimLayer> = (0..4).map(|_| layer(0.1, Some(1))).collect();
    assert!((node_s_per_token(&io_bound, 1.0, 4, 0.0) - 4.0).abs() < 1e-9);
    assert!((node_s_per_token(&io_bound, 1.0, 1, 0.0) - 4.0).abs() < 1e-9);
    // Compute bound: the reads hide behind the compute.
    let cpu_bound: Vec<SimLayer> = (0..4).map(|_| layer(1.0, Some(1))).collect();
    let s = node_s_per_token(&cpu_bound, 10.0, 1, 0.0);
    assert!((s - 4.0).abs() < 1e-9, "{s}");
    // A slower disk makes it slower; a resident layer instead of a streamed one, faster.
    let base = node_s_per_token(&io_bound, 1.0, 2, 0.0);
    assert!(node_s_per_token(&io_bound, 0.5, 2, 0.0) > base);
    let mut part = io_bound.clone();
    part[0].streamed_bytes = None;
    assert!(node_s_per_token(&part, 1.0, 2, 0.0) < base);
}

#[test]
fn tiers_keep_a_resident_prefix_and_a_pool_within_the_budget() {
    let layers: Vec<(usize, u64)> = (0..10).map(|i| (i, 100 << 20)).collect();
    // Everything fits: nothing streams.
    let t = plan_tiers(&layers, 2000 << 20, 2).unwrap();
    assert!(t.streamed.is_empty());
    // 1000 MiB of layers in 600 MiB: a pool of 3 (depth 2) layers, the rest resident first.
    let t = plan_tiers(&layers, 600 << 20, 2).unwrap();
    assert!(t.pool_bytes >= 300 << 20 && t.pool_bytes < 301 << 20);
    assert!(t.resident_bytes + t.pool_bytes <= 600 << 20);
    let resident: Vec<usize> = (0..10).filter(|l| !t.streamed.contains(l)).collect();
    assert_eq!(resident, vec![0, 1]);
    assert_eq!(t.streamed, (2..10).collect::<Vec<_>>());
    assert_eq!(t.streamed_bytes, 800 << 20);
    // Not even the pool: refused.
    assert!(plan_tiers(&layers, 250 << 20, 2).is_none());
}

/// Tokens through a runner: a prefill batch, then single tokens; the logits of each step.
fn logits_of(model: Arc<Model>, prompt: &[u32], then: &[u32]) -> Vec<Vec<f32>> {
    let mut r = Runner::new(model, 1, 16, 48);
    let mut kv = r.new_cache(48, KvType::F32);
    let mut x = Vec::new();
    let mut logits = vec![0f32; r.model.hp.vocab];
    let mut out = Vec::new();
    r.step(prompt, &mut kv, &mut x, &mut logits).unwrap();
    out.push(logits.clone());
    for &t in then {
        r.step(&[t], &mut kv, &mut x, &mut logits).unwrap();
        out.push(logits.clone());
    }
    out
}

/// A mixture of experts whose experts stream from disk gives the resident model's bits: with
/// the smallest cache (a prefill batch needs more experts than it holds), a middling one and
/// one that holds every expert; with and without the next layer's experts predicted; read
/// with O_DIRECT (or the page cache) and from memory. The counters add up.
#[test]
fn streamed_experts_give_the_resident_models_bits_at_every_cache_size_and_prediction() {
    use ringllm_model::stream::{ExpertLayout, ExpertStore};
    for (arch, ty) in [
        (SynthArch::Qwen3Moe, GgmlType::Q8_0),
        (SynthArch::Qwen3Moe, GgmlType::Q4_K),
        (SynthArch::Mixtral, GgmlType::Q4_0),
        (SynthArch::GptOss, GgmlType::MXFP4),
    ] {
        let (disk, mem) = files(arch, ty, &format!("experts-{}-{ty:?}", arch.name()));
        let resident = Arc::new(Model::load(Arc::clone(&disk), &LoadOptions::default()).unwrap());
        let n = resident.hp.n_layer;
        let moe = resident.hp.moe.expect("a mixture of experts");
        let prompt: Vec<u32> = (0..12).map(|i| 3 + i * 7).collect();
        let then = [3u32, 11, 4, 6, 9, 2];
        let want = logits_of(Arc::clone(&resident), &prompt, &then);
        let layers: Vec<usize> = (0..n).collect();
        let all = moe.n_expert * n;
        for file in [&disk, &mem] {
            for slots in [ExpertLayout::min_slots(), all / 2, all] {
                for predict in [false, true] {
                    let layout = ExpertLayout::new(file, &layers).unwrap();
                    let st = Arc::new(ExpertStore::new(file, layout, slots, predict).unwrap());
                    for repack in [false, true] {
                        let m = Model::load(
                            Arc::clone(file),
                            &LoadOptions {
                                repack,
                                experts: Some(Arc::clone(&st)),
                                ..LoadOptions::default()
                            },
                        )
                        .unwrap();
                        let got = logits_of(Arc::new(m), &prompt, &then);
                        let what = format!(
                            "{} {ty:?} slots {slots} predict {predict} repack {repack} from {}",
                            arch.name(),
                            st.source()
                        );
                        assert_eq!(got, want, "{what}");
                    }
                    let s = st.stats();
                    let what = format!("{} slots {slots} predict {predict}: {s:?}", arch.name());
                    // Every pass of every layer used at least k experts.
                    assert!(s.used >= 2 * 7 * (n * moe.n_used) as u64, "{what}");
                    assert!(s.hits + s.prefetched <= s.used, "{what}");
                    // Whatever was not in the cache was read.
                    assert!(s.reads >= s.used - s.hits - s.prefetched, "{what}");
                    assert!(s.predicted_right <= s.used_with_prediction, "{what}");
                    if predict {
                        assert!(s.predicted > 0, "{what}");
                    } else {
                        assert_eq!(s.predicted + s.predicted_reads, 0, "{what}");
                    }
                    if slots >= all {
                        // A cache of every expert reads each at most once.
                        assert!(s.reads <= all as u64, "{what}");
                        assert!(s.hits > 0, "{what}");
                    }
                }
            }
        }
    }
}
