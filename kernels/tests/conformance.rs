//! One conformance harness for every format and every ISA (as ggml's test-backend-ops):
//! the detected kernels are compared with the scalar reference on random data, within the
//! budgets of `ringllm_kernels::tolerance`.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ringllm_kernels::tolerance::budget;
use ringllm_kernels::{kernels, reference, GgmlType, ALL_TYPES};

/// Standard normal samples (Box–Muller), seeded so failures reproduce.
fn normal(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f32 = rng.random_range(1e-7f32..1.0);
            let u2: f32 = rng.random::<f32>();
            (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
        })
        .collect()
}

fn quantize(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let bytes = ty.row_bytes(x.len()).expect("whole blocks");
    let mut out = vec![0u8; bytes];
    (reference(ty).quantize)(x, &mut out);
    out
}

fn dequantize(ty: GgmlType, q: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    (reference(ty).dequantize)(q, &mut out);
    out
}

/// Weight types: every type that can appear in a model file (not the activation-only ones).
fn weight_types() -> impl Iterator<Item = GgmlType> {
    ALL_TYPES
        .iter()
        .copied()
        .filter(|t| !matches!(t, GgmlType::Q8_1 | GgmlType::Q8_K))
}

fn row_len(ty: GgmlType) -> usize {
    // 8 K-blocks = 2048, also a whole number of every 32-block type.
    let _ = ty;
    2048
}

#[test]
fn roundtrip_error_within_budget() {
    let mut rng = StdRng::seed_from_u64(7);
    for ty in ALL_TYPES {
        let n = row_len(ty);
        for _ in 0..4 {
            let x = normal(&mut rng, n);
            let y = dequantize(ty, &quantize(ty, &x), n);
            let err: f32 = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>();
            let norm: f32 = x.iter().map(|a| a * a).sum::<f32>();
            let rel = (err / norm).sqrt();
            assert!(
                rel <= budget(ty).roundtrip_rmse,
                "{ty}: roundtrip relative RMSE {rel} > {}",
                budget(ty).roundtrip_rmse
            );
        }
    }
}

#[test]
fn detected_dequantize_equals_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    for ty in ALL_TYPES {
        let n = row_len(ty);
        let q = quantize(ty, &normal(&mut rng, n));
        let want = dequantize(ty, &q, n);
        let mut got = vec![0f32; n];
        (kernels(ty).dequantize)(&q, &mut got);
        assert_eq!(got, want, "{ty} ({:?})", kernels(ty).isa);
    }
}

#[test]
fn dot_products_within_budget() {
    let mut rng = StdRng::seed_from_u64(13);
    for ty in weight_types() {
        let n = row_len(ty);
        let k = kernels(ty);
        let r = reference(ty);
        assert_eq!(k.vec_dot_type, r.vec_dot_type, "{ty}");
        for _ in 0..8 {
            let w = quantize(ty, &normal(&mut rng, n));
            let a = normal(&mut rng, n);
            let aq = quantize(r.vec_dot_type, &a);
            let wf = dequantize(ty, &w, n);
            let exact: f64 = wf
                .iter()
                .zip(&a)
                .map(|(x, y)| (*x as f64) * (*y as f64))
                .sum();
            let scale: f64 = wf
                .iter()
                .zip(&a)
                .map(|(x, y)| ((*x as f64) * (*y as f64)).abs())
                .sum();
            let want = (r.vec_dot)(n, &w, &aq);
            let got = (k.vec_dot)(n, &w, &aq);
            let b = budget(ty);
            let vs_float = ((want as f64 - exact) / scale).abs();
            assert!(
                vs_float <= b.dot_vs_float as f64,
                "{ty}: reference dot vs float {vs_float}"
            );
            let vs_ref = ((got as f64 - want as f64) / scale).abs();
            assert!(
                vs_ref <= b.simd_vs_reference as f64,
                "{ty} ({:?}): dot {got} vs reference {want}, relative {vs_ref}",
                k.isa
            );
        }
    }
}

#[test]
fn tiled_dot_equals_single_dots() {
    let mut rng = StdRng::seed_from_u64(17);
    for ty in weight_types() {
        let k = kernels(ty);
        let Some(multi) = k.vec_dot_multi else {
            continue;
        };
        let n = row_len(ty);
        let w = quantize(ty, &normal(&mut rng, n));
        for rows in 1..=9 {
            let stride = k.vec_dot_type.row_bytes(n).expect("whole blocks");
            let mut acts = Vec::with_capacity(rows * stride);
            for _ in 0..rows {
                acts.extend(quantize(k.vec_dot_type, &normal(&mut rng, n)));
            }
            let mut out = vec![0f32; rows];
            multi(n, &w, &acts, stride, &mut out);
            for (i, got) in out.iter().enumerate() {
                let want = (k.vec_dot)(n, &w, &acts[i * stride..(i + 1) * stride]);
                let tol = 1e-5 * want.abs().max(1.0);
                assert!(
                    (got - want).abs() <= tol,
                    "{ty}: row {i}/{rows}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn row_tiled_dot_equals_single_dots() {
    let mut rng = StdRng::seed_from_u64(19);
    for ty in weight_types() {
        let k = kernels(ty);
        let Some(rows_fn) = k.vec_dot_rows else {
            continue;
        };
        let n = row_len(ty);
        let rb = ty.row_bytes(n).expect("whole blocks");
        let a = quantize(k.vec_dot_type, &normal(&mut rng, n));
        for rows in 1..=9 {
            let mut w = Vec::with_capacity(rows * rb);
            for _ in 0..rows {
                w.extend(quantize(ty, &normal(&mut rng, n)));
            }
            let mut out = vec![0f32; rows];
            rows_fn(n, &w, rb, &a, &mut out);
            for (i, got) in out.iter().enumerate() {
                let want = (k.vec_dot)(n, &w[i * rb..(i + 1) * rb], &a);
                assert_eq!(*got, want, "{ty}: weight row {i}/{rows}");
            }
        }
    }
}

#[test]
fn weight_by_activation_tiles_equal_single_dots() {
    let mut rng = StdRng::seed_from_u64(23);
    for ty in weight_types() {
        let k = kernels(ty);
        let Some(tile_fn) = k.vec_dot_tile else {
            continue;
        };
        let n = row_len(ty);
        let rb = ty.row_bytes(n).expect("whole blocks");
        let ab = k.vec_dot_type.row_bytes(n).expect("whole blocks");
        for (n_w, n_a) in [(1, 1), (2, 2), (3, 2), (5, 3), (7, 8), (4, 5)] {
            let mut w = Vec::new();
            for _ in 0..n_w {
                w.extend(quantize(ty, &normal(&mut rng, n)));
            }
            let mut a = Vec::new();
            for _ in 0..n_a {
                a.extend(quantize(k.vec_dot_type, &normal(&mut rng, n)));
            }
            let stride = n_w + 3; // output rows wider than the tile
            let mut out = vec![f32::NAN; n_a * stride];
            tile_fn(n, &w, rb, n_w, &a, ab, n_a, &mut out, stride);
            for r in 0..n_a {
                for o in 0..n_w {
                    let want = (k.vec_dot)(n, &w[o * rb..(o + 1) * rb], &a[r * ab..(r + 1) * ab]);
                    assert_eq!(
                        out[r * stride + o],
                        want,
                        "{ty}: weight row {o}, activation row {r}"
                    );
                }
                assert!(out[r * stride + n_w..(r + 1) * stride]
                    .iter()
                    .all(|v| v.is_nan()));
            }
        }
    }
}

/// A batch (decode of a few sequences, prefill; the GEMM kernels where the level has them) gives every row the bits
/// that row gets alone (the decode kernel), and the values the reference dot gives within
/// budget: batching never changes a sequence's output.
#[test]
fn batched_matmul_equals_row_by_row() {
    use ringllm_kernels::{matmul, ActBuffer, QMatrix, ThreadPool};
    let mut rng = StdRng::seed_from_u64(29);
    let pool = ThreadPool::new(2);
    let mut acts = ActBuffer::new();
    for ty in weight_types() {
        // 640 columns: 20 legacy blocks (an even count), 2.5 K-blocks where K-quants skip;
        // 2048: 8 K-blocks (the K-quants' tiles: 37 rows are two whole tiles and a part).
        for n in [640usize, 2048, 2048 + 32] {
            if ty.row_bytes(n).is_none() {
                continue;
            }
            let n_out = 37;
            let mut w = Vec::new();
            for _ in 0..n_out {
                w.extend(quantize(ty, &normal(&mut rng, n)));
            }
            let m = QMatrix {
                ty,
                n_in: n,
                n_out,
                data: &w,
                packed: false,
            };
            for n_rows in [2usize, 3, 5, 8, 9, 13, 40] {
                let x = normal(&mut rng, n * n_rows);
                let mut batched = vec![0f32; n_rows * n_out];
                matmul(&pool, &m, &x, n_rows, &mut batched, &mut acts);
                for r in 0..n_rows {
                    let mut one = vec![0f32; n_out];
                    matmul(&pool, &m, &x[r * n..(r + 1) * n], 1, &mut one, &mut acts);
                    let got = &batched[r * n_out..(r + 1) * n_out];
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{ty} n={n}: row {r} of a batch of {n_rows} differs from it alone"
                    );
                    let at = reference(ty).vec_dot_type;
                    let qa = quantize(at, &x[r * n..(r + 1) * n]);
                    for (o, g) in got.iter().enumerate() {
                        let rb = ty.row_bytes(n).expect("whole blocks");
                        let want = (reference(ty).vec_dot)(n, &w[o * rb..(o + 1) * rb], &qa);
                        let scale: f32 = dequantize(ty, &w[o * rb..(o + 1) * rb], n)
                            .iter()
                            .zip(&x[r * n..(r + 1) * n])
                            .map(|(a, b)| (a * b).abs())
                            .sum();
                        assert!(
                            (g - want).abs() <= 1e-5 * scale.max(1.0),
                            "{ty} n={n}: row {r} col {o}: {g} vs reference {want}"
                        );
                        // Every K-quant kernel reduces each block's integers exactly and then
                        // takes the reference's float steps: the reference's bits.
                        if at == GgmlType::Q8_K {
                            assert_eq!(
                                g.to_bits(),
                                want.to_bits(),
                                "{ty} n={n}: row {r} col {o}: {g} vs reference {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Matrices repacked into panels give the same bits as in the GGUF layout, alone and in one
/// pool pass with others whose row counts leave panels unaligned, at every batch size; an
/// embedding row read back from panels is the row.
#[test]
fn repacked_matrices_give_the_same_bits() {
    use ringllm_kernels::{matmul, matmul_many, repack, ActBuffer, MatJob, QMatrix, ThreadPool};
    let packable: Vec<GgmlType> = weight_types().filter(|&t| repack::available(t)).collect();
    if packable.is_empty() {
        eprintln!(
            "SKIPPED repacked_matrices_give_the_same_bits: no panel kernels at {:?}",
            ringllm_kernels::isa()
        );
        return;
    }
    let mut rng = StdRng::seed_from_u64(31);
    let pool = ThreadPool::new(2);
    let mut acts = ActBuffer::new();
    for ty in packable {
        let widths: &[usize] = if ty.block_size() == 256 {
            &[768, 256]
        } else {
            &[640, 96]
        };
        for &n in widths {
            // 37 rows: 9 panels of 4 and a tail row, or 2 of 16 and 5; 6 rows: one panel of
            // 4 and two tail rows, or all tail; 16 and 4: whole panels of one layout.
            for n_out in [37usize, 6, 4, 16] {
                let mut w = Vec::new();
                for _ in 0..n_out {
                    w.extend(quantize(ty, &normal(&mut rng, n)));
                }
                let mut p = vec![0u8; w.len()];
                repack::repack(ty, n, n_out, &w, &mut p);
                let rows = QMatrix {
                    ty,
                    n_in: n,
                    n_out,
                    data: &w,
                    packed: false,
                };
                let panels = QMatrix {
                    packed: true,
                    data: &p,
                    ..rows
                };
                let mut a = vec![0f32; n];
                let mut b = vec![0f32; n];
                for r in 0..n_out {
                    rows.dequantize_row(r, &mut a);
                    panels.dequantize_row(r, &mut b);
                    assert_eq!(a, b, "{ty}: row {r} read back from panels");
                }
                for n_rows in [1usize, 2, 5, 8, 9, 33] {
                    let x = normal(&mut rng, n * n_rows);
                    let mut want = vec![0f32; n_rows * n_out];
                    let mut got = vec![0f32; n_rows * n_out];
                    matmul(&pool, &rows, &x, n_rows, &mut want, &mut acts);
                    matmul(&pool, &panels, &x, n_rows, &mut got, &mut acts);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{ty} {n_out}x{n}, batch {n_rows}");
                    // An unaligned job first, then the panels, then the rows again.
                    let odd = QMatrix {
                        n_out: n_out - 1,
                        ..rows
                    };
                    let mut o1 = vec![0f32; n_rows * (n_out - 1)];
                    let mut o2 = vec![0f32; n_rows * n_out];
                    let mut o3 = vec![0f32; n_rows * n_out];
                    matmul_many(
                        &pool,
                        &mut [
                            MatJob {
                                w: odd,
                                out: &mut o1,
                            },
                            MatJob {
                                w: panels,
                                out: &mut o2,
                            },
                            MatJob {
                                w: rows,
                                out: &mut o3,
                            },
                        ],
                        &x,
                        n_rows,
                        &mut acts,
                    );
                    assert_eq!(
                        bits(&o2),
                        bits(&want),
                        "{ty} {n_out}x{n}, batch {n_rows}, many"
                    );
                    assert_eq!(
                        bits(&o3),
                        bits(&want),
                        "{ty} {n_out}x{n}, batch {n_rows}, rows"
                    );
                    for r in 0..n_rows {
                        assert_eq!(
                            bits(&o1[r * (n_out - 1)..(r + 1) * (n_out - 1)]),
                            bits(&want[r * n_out..r * n_out + n_out - 1]),
                            "{ty} {n_out}x{n}, batch {n_rows}, unaligned job"
                        );
                    }
                }
            }
        }
    }
}

/// The level `RINGLLM_ISA` names is the level this suite runs at whenever the CPU has it (and
/// the best lower one when it does not), so one run per level really covers that level.
#[test]
fn requested_level_is_the_level_tested() {
    let name = ringllm_kernels::isa().name();
    eprintln!("kernel level under test: {name}");
    let Ok(want) = std::env::var("RINGLLM_ISA") else {
        return;
    };
    let want = want.trim().to_ascii_lowercase();
    if want == "scalar" {
        assert_eq!(name, "scalar");
    }
    #[cfg(target_arch = "aarch64")]
    {
        let dotprod = std::arch::is_aarch64_feature_detected!("dotprod");
        let i8mm = dotprod && std::arch::is_aarch64_feature_detected!("i8mm");
        let expect = match want.as_str() {
            "neon" => Some("neon"),
            "dotprod" | "neon+dotprod" => Some(if dotprod { "neon+dotprod" } else { "neon" }),
            "i8mm" | "neon+i8mm" => Some(match (i8mm, dotprod) {
                (true, _) => "neon+i8mm",
                (false, true) => "neon+dotprod",
                _ => "neon",
            }),
            _ => None,
        };
        if let Some(expect) = expect {
            assert_eq!(name, expect, "RINGLLM_ISA={want}");
        }
    }
}
