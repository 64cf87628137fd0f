//! The GPU matmul kernels of every weight format against the host: `ringllm_kernels`'
//! scalar dequantize (the oracle of every CPU kernel) and an f64 dot product. Runs on
//! whatever adapter wgpu finds (Mesa lavapipe in CI).

use std::sync::OnceLock;

use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use ringllm_gpu::qmat::synthetic_weights;
use ringllm_gpu::{
    bench_matvec, Gpu, GpuError, GpuOptions, Matmul, MatmulVariant, QMatrix, GPU_TYPES,
};
use ringllm_kernels::{reference, GgmlType};

/// Error budget per output: |gpu − ref| ≤ REL·Σ|w·x| + ABS. The GPU sums the same f32
/// products (exact dequantized weights, f32 activations) in another order than the f64
/// oracle, with possibly fused multiply-adds: n terms in f32 are off by at most about
/// n·2⁻²⁴·Σ|w·x| (worst case; typical √n·2⁻²⁴). REL = 1e-4 is that worst case for
/// n ≈ 1700, above our longest rows (1280 columns), so a failure means a wrong value, not
/// rounding; ABS covers outputs whose Σ|w·x| is ≈ 0.
const REL: f64 = 1e-4;
const ABS: f64 = 1e-5;

fn gpu() -> &'static Gpu {
    static G: OnceLock<Gpu> = OnceLock::new();
    G.get_or_init(|| {
        Gpu::open(&GpuOptions {
            allow_software: true,
            ..Default::default()
        })
        .expect("a GPU adapter (install mesa-vulkan-drivers for lavapipe)")
    })
}

fn default_matmul() -> &'static Matmul {
    static M: OnceLock<Matmul> = OnceLock::new();
    M.get_or_init(|| Matmul::new(gpu()).expect("matmul"))
}

/// A random f16 scale: mostly 1e-4 .. 0.1, one in eight subnormal, either sign.
fn scale(rng: &mut StdRng) -> [u8; 2] {
    let mag = if rng.random_range(0..8) == 0 {
        rng.random_range(1e-7f32..6e-5)
    } else {
        rng.random_range(1e-4f32..0.1)
    };
    let v = if rng.random::<bool>() { mag } else { -mag };
    half::f16::from_f32(v).to_le_bytes()
}

/// Random valid GGUF bytes of `rows × cols` values of `ty`: random quants and packed
/// scales, finite random f16 scales; floats in (−1, 1).
fn weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut StdRng) -> Vec<u8> {
    let len = ty.row_bytes(cols).expect("whole blocks") * rows;
    let mut b = vec![0u8; len];
    rng.fill_bytes(&mut b);
    match ty {
        GgmlType::F32 => b
            .chunks_exact_mut(4)
            .for_each(|c| c.copy_from_slice(&rng.random_range(-1f32..1.0).to_le_bytes())),
        GgmlType::F16 => b.chunks_exact_mut(2).for_each(|c| {
            c.copy_from_slice(&half::f16::from_f32(rng.random_range(-1f32..1.0)).to_le_bytes())
        }),
        GgmlType::BF16 => b.chunks_exact_mut(2).for_each(|c| {
            c.copy_from_slice(&half::bf16::from_f32(rng.random_range(-1f32..1.0)).to_le_bytes())
        }),
        // Scale bytes (E8M0): a few of 0, 1 and 2 (subnormal scales), the rest 100..150
        // (2^-28..2^22), every value finite.
        GgmlType::MXFP4 => {
            for (i, blk) in b.chunks_exact_mut(ty.type_size()).enumerate() {
                blk[0] = match i % 16 {
                    k @ 0..=2 => k as u8,
                    _ => 100 + blk[0] % 50,
                };
            }
        }
        _ => {
            // Byte offsets of the f16 fields of a block.
            let fields: &[usize] = match ty {
                GgmlType::Q4_0
                | GgmlType::Q5_0
                | GgmlType::Q8_0
                | GgmlType::IQ4_NL
                | GgmlType::IQ4_XS => &[0],
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
                GgmlType::Q6_K => &[208],
                GgmlType::Q2_K => &[80, 82],
                GgmlType::Q3_K => &[108],
                _ => unreachable!("{ty}"),
            };
            for blk in b.chunks_exact_mut(ty.type_size()) {
                for &f in fields {
                    blk[f..f + 2].copy_from_slice(&scale(rng));
                }
            }
        }
    }
    b
}

fn host_dequantize(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Vec<f32> {
    let mut w = vec![0f32; rows * cols];
    (reference(ty).dequantize)(bytes, &mut w);
    w
}

const X_OFF: u64 = 3;
const Y_OFF: u64 = 5;
const SENTINEL: f32 = 12345.5;

/// Runs y = x·Wᵀ for `n` random rows on the GPU and checks every output against the
/// host; returns the largest |gpu − ref| / Σ|w·x|.
fn check_product(mm: &Matmul, w: &QMatrix, wf: &[f32], n: usize, rng: &mut StdRng) -> f64 {
    let g = gpu();
    let (rows, cols) = (w.rows, w.cols);
    let xs: Vec<f32> = (0..n * cols)
        .map(|_| rng.random_range(-1f32..1.0))
        .collect();
    let x = g
        .storage("x", (X_OFF as usize + n * cols + 7) as u64 * 4)
        .unwrap();
    g.write_f32(&x, X_OFF, &xs);
    let ylen = Y_OFF as usize + n * rows + 9;
    let y = g.storage("y", ylen as u64 * 4).unwrap();
    g.write_f32(&y, 0, &vec![SENTINEL; ylen]);
    let mut enc = g
        .device()
        .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
    mm.encode(g, &mut enc, w, &x, X_OFF, &y, Y_OFF, n as u32)
        .unwrap();
    g.queue().submit([enc.finish()]);
    let mut out = vec![0f32; ylen];
    g.read_f32(&y, 0, &mut out).unwrap();
    let what = format!("{:?} n={n} variant {:?}", w, mm.variant());
    let end = Y_OFF as usize + n * rows;
    assert!(
        out[..Y_OFF as usize]
            .iter()
            .chain(&out[end..])
            .all(|v| *v == SENTINEL),
        "{what}: wrote outside y[{Y_OFF}..{end}]"
    );
    let mut worst = 0f64;
    for m in 0..n {
        let xr = &xs[m * cols..(m + 1) * cols];
        for r in 0..rows {
            let wr = &wf[r * cols..(r + 1) * cols];
            let (mut want, mut mag) = (0f64, 0f64);
            for (a, b) in wr.iter().zip(xr) {
                let p = f64::from(*a) * f64::from(*b);
                want += p;
                mag += p.abs();
            }
            let got = f64::from(out[Y_OFF as usize + m * rows + r]);
            let err = (got - want).abs();
            assert!(
                err <= REL * mag + ABS,
                "{what}: y[{m}][{r}] = {got}, want {want} (|err| {err:e}, Σ|w·x| {mag:e})"
            );
            if mag > 0.0 {
                worst = worst.max(err / mag);
            }
        }
    }
    worst
}

/// Shapes (rows, cols): rows never a multiple of a workgroup's 4 (matvec) or 32 (tiled)
/// rows; columns at and across the matvec's 1024-value activation tile.
fn shapes(ty: GgmlType) -> &'static [(usize, usize)] {
    match ty.block_size() {
        1 => &[(37, 640), (5, 576), (70, 45), (3, 1100)],
        32 => &[(37, 640), (5, 576), (70, 1056), (1, 32)],
        _ => &[(37, 256), (5, 1280), (70, 512)],
    }
}

fn every_shape(ty: GgmlType) {
    let mut rng = StdRng::seed_from_u64(0x5eed ^ ty as u64);
    let mm = default_matmul();
    let mut worst = [0f64; 3];
    for &(rows, cols) in shapes(ty) {
        let bytes = weights(ty, rows, cols, &mut rng);
        let w = QMatrix::upload(gpu(), ty, rows, cols, &bytes, "test").unwrap();
        let wf = host_dequantize(ty, rows, cols, &bytes);
        for (i, n) in [1, 3, 17].into_iter().enumerate() {
            worst[i] = worst[i].max(check_product(mm, &w, &wf, n, &mut rng));
        }
    }
    println!(
        "{ty}: max |gpu − ref| / Σ|w·x|: n=1 {:.2e}, n=3 {:.2e}, n=17 {:.2e} ({:?})",
        worst[0],
        worst[1],
        worst[2],
        mm.variant()
    );
}

macro_rules! format_tests {
    ($($name:ident => $ty:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                every_shape(GgmlType::$ty);
            }
        )*
    };
}

format_tests! {
    matmul_f32 => F32,
    matmul_f16 => F16,
    matmul_bf16 => BF16,
    matmul_q4_0 => Q4_0,
    matmul_q4_1 => Q4_1,
    matmul_q5_0 => Q5_0,
    matmul_q5_1 => Q5_1,
    matmul_q8_0 => Q8_0,
    matmul_q4_k => Q4_K,
    matmul_q5_k => Q5_K,
    matmul_q6_k => Q6_K,
    matmul_q2_k => Q2_K,
    matmul_q3_k => Q3_K,
}

/// The shaders' decoding of every format, in the default variant and with f16 off, is
/// bit-for-bit the host's dequantize (subnormal scales included).
#[test]
fn gpu_dequantize_keeps_the_gguf_bits() {
    let g = gpu();
    let mut variants = vec![default_matmul()];
    let plain = Matmul::with_variant(
        g,
        MatmulVariant {
            subgroups: false,
            f16: false,
        },
    )
    .unwrap();
    if default_matmul().variant().f16 {
        variants.push(&plain);
    } else {
        println!("dequantize: no shader-f16 on this adapter, one variant checked");
    }
    let mut rng = StdRng::seed_from_u64(7);
    for ty in GPU_TYPES {
        let (rows, cols) = (9, if ty.block_size() == 256 { 512 } else { 96 });
        let bytes = weights(ty, rows, cols, &mut rng);
        let w = QMatrix::upload(g, ty, rows, cols, &bytes, "bits").unwrap();
        let want = host_dequantize(ty, rows, cols, &bytes);
        for mm in &variants {
            let got = mm.dequantize(g, &w).unwrap();
            assert_eq!(got.len(), want.len());
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{ty} {:?}: value {i} (row {}, col {}): gpu {a:e}, host {b:e}",
                    mm.variant(),
                    i / cols,
                    i % cols
                );
            }
        }
    }
}

/// Every variant the adapter allows (subgroup or workgroup-memory reduction; f16 or
/// unpack2x16float scales), forced, on every format, decode and prefill.
#[test]
fn every_variant_matches_the_host_oracle() {
    let g = gpu();
    let mut rng = StdRng::seed_from_u64(11);
    let mut ran = Vec::new();
    for subgroups in [false, true] {
        for f16 in [false, true] {
            let v = MatmulVariant { subgroups, f16 };
            if v == default_matmul().variant() {
                continue; // the per-format tests ran it
            }
            let mm = match Matmul::with_variant(g, v) {
                Ok(m) => m,
                Err(GpuError::Invalid(why)) => {
                    println!("variant {v:?} not available here: {why}");
                    continue;
                }
                Err(e) => panic!("{e}"),
            };
            for ty in GPU_TYPES {
                let (rows, cols) = (37, if ty.block_size() == 256 { 512 } else { 1056 });
                let bytes = weights(ty, rows, cols, &mut rng);
                let w = QMatrix::upload(g, ty, rows, cols, &bytes, "variant").unwrap();
                let wf = host_dequantize(ty, rows, cols, &bytes);
                let e1 = check_product(&mm, &w, &wf, 1, &mut rng);
                let e17 = check_product(&mm, &w, &wf, 17, &mut rng);
                println!("{v:?} {ty}: n=1 {e1:.2e}, n=17 {e17:.2e}");
            }
            ran.push(v);
        }
    }
    println!("variants checked besides the default: {ran:?}");
    let s = g.summary();
    let expected =
        (1 + usize::from(s.subgroups.is_some_and(|n| n >= 4))) * (1 + usize::from(s.f16)) - 1;
    assert_eq!(ran.len(), expected, "{s}");
}

/// A matrix split into several buffers by rows (a small test limit; real ones exceed
/// the device's storage binding) gives the same products and bits.
#[test]
fn rows_split_across_buffers() {
    let g = gpu();
    let mm = default_matmul();
    let mut rng = StdRng::seed_from_u64(13);
    for (ty, rows, cols, per_chunk) in [
        (GgmlType::Q4_K, 70, 512, 25),
        (GgmlType::Q4_0, 61, 640, 16),
        (GgmlType::F16, 40, 100, 13),
    ] {
        let bytes = weights(ty, rows, cols, &mut rng);
        // Device bytes of a buffer of r rows: Q4_K blocks as they are; Q4_0 nibbles
        // (16 bytes a block), then the f16 scales rounded up to 16 bytes; F16 rows padded
        // to 128 values.
        let chunk = |r: usize| match ty {
            GgmlType::Q4_K => r * 288,
            GgmlType::Q4_0 => r * 20 * 16 + (r * 20 * 2).next_multiple_of(16),
            _ => r * 2 * cols.div_ceil(32) * 32,
        };
        let limit = (chunk(per_chunk) + 16) as u64;
        let w = QMatrix::upload_with_limit(g, ty, rows, cols, &bytes, "split", limit).unwrap();
        assert_eq!(w.buffers(), rows.div_ceil(per_chunk), "{w:?}");
        let full = rows / per_chunk;
        assert_eq!(
            w.device_bytes(),
            (full * chunk(per_chunk) + chunk(rows - full * per_chunk)) as u64
        );
        let wf = host_dequantize(ty, rows, cols, &bytes);
        let got = mm.dequantize(g, &w).unwrap();
        assert!(
            got.iter().zip(&wf).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{w:?}: dequantized bits differ"
        );
        for n in [1, 3, 17] {
            check_product(mm, &w, &wf, n, &mut rng);
        }
    }
}

/// Grids limited to 3 workgroups per dimension: every kernel spreads a matrix's rows over
/// a 2-D grid with idle workgroups at its end (as the 65535 limit does to a matrix of
/// more than 65535 workgroups of rows), and the tiled kernel's activation rows over z.
#[test]
fn two_dimensional_grids() {
    let g = gpu();
    let v = default_matmul().variant();
    let mm = Matmul::with_variant(g, v).unwrap().with_grid_limit(3);
    let mut rng = StdRng::seed_from_u64(17);
    for (ty, rows, cols) in [(GgmlType::Q8_0, 133, 64), (GgmlType::Q6_K, 70, 256)] {
        let bytes = weights(ty, rows, cols, &mut rng);
        let w = QMatrix::upload(g, ty, rows, cols, &bytes, "grid").unwrap();
        let wf = host_dequantize(ty, rows, cols, &bytes);
        // Q8_0: 9 matvec workgroups of 16 rows (a 3 × 3 grid), 5 tiles of 32 rows (3 × 2);
        // Q6_K: 5 matvec workgroups (3 × 2), 9 dequantize workgroups (3 × 3).
        for n in [1, 3, 40] {
            check_product(&mm, &w, &wf, n, &mut rng);
        }
        let got = mm.dequantize(g, &w).unwrap();
        assert!(got.iter().zip(&wf).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    // Beyond 3 × 3 workgroups: a clear error, not a wrong result.
    let bytes = weights(GgmlType::Q8_0, 145, 32, &mut rng);
    let w = QMatrix::upload(g, GgmlType::Q8_0, 145, 32, &bytes, "grid").unwrap();
    let x = g.storage("x", 32 * 4).unwrap();
    let y = g.storage("y", 145 * 4).unwrap();
    let mut enc = g
        .device()
        .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
    match mm.encode(g, &mut enc, &w, &x, 0, &y, 0, 1) {
        Err(GpuError::Invalid(m)) => assert!(m.contains("3 × 3 grid"), "{m}"),
        other => panic!("expected a grid error, got {other:?}"),
    }
}

/// Gemma's tied output head has 262,144 rows: the row count of the real thing (word
/// offsets, 16384 matvec workgroups), with short rows to keep the test fast.
#[test]
fn a_262k_row_head() {
    let g = gpu();
    let mut rng = StdRng::seed_from_u64(19);
    let (ty, rows, cols) = (GgmlType::Q8_0, 262_147, 32);
    let bytes = weights(ty, rows, cols, &mut rng);
    let w = QMatrix::upload(g, ty, rows, cols, &bytes, "head").unwrap();
    let wf = host_dequantize(ty, rows, cols, &bytes);
    check_product(default_matmul(), &w, &wf, 1, &mut rng);
}

#[test]
fn bad_sizes_and_types_are_clear_errors() {
    let g = gpu();
    let msg = |r: Result<QMatrix, GpuError>| match r {
        Err(GpuError::Invalid(m)) => m,
        other => panic!("expected Invalid, got {other:?}"),
    };
    let ok = [0u8; 2 * 34 * 2];
    let m = msg(QMatrix::upload(
        g,
        GgmlType::Q8_0,
        2,
        64,
        &ok[..ok.len() - 1],
        "blk.0.ffn_up",
    ));
    assert!(
        m.contains("blk.0.ffn_up") && m.contains("135 bytes given"),
        "{m}"
    );
    let m = msg(QMatrix::upload(g, GgmlType::Q8_0, 2, 64, &[0; 137], "t"));
    assert!(m.contains("need 136"), "{m}");
    let m = msg(QMatrix::upload(g, GgmlType::Q4_K, 1, 576, &[0; 324], "t"));
    assert!(m.contains("576 columns") && m.contains("256"), "{m}");
    let m = msg(QMatrix::upload(g, GgmlType::Q8_0, 1, 33, &[0; 34], "t"));
    assert!(m.contains("33 columns"), "{m}");
    for ty in [GgmlType::Q8_1, GgmlType::Q8_K] {
        let len = ty.row_bytes(256).unwrap();
        let m = msg(QMatrix::upload(g, ty, 1, 256, &vec![0; len], "act"));
        assert!(m.contains("not a weight format"), "{m}");
    }
    let m = msg(QMatrix::upload(g, GgmlType::F32, 0, 4, &[], "t"));
    assert!(m.contains("empty"), "{m}");
    // A row larger than the chunk limit cannot be split.
    let m = msg(QMatrix::upload_with_limit(
        g,
        GgmlType::F32,
        1,
        64,
        &[0; 256],
        "t",
        255,
    ));
    assert!(m.contains("one row takes 256"), "{m}");

    // Buffers too small for the rows and offsets asked for.
    let w = QMatrix::upload(g, GgmlType::F32, 3, 8, &[0; 96], "w").unwrap();
    let mm = default_matmul();
    let x = g.storage("x", 2 * 8 * 4).unwrap();
    let y = g.storage("y", 2 * 3 * 4).unwrap();
    let mut enc = g
        .device()
        .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
    let enc_err = |r: Result<(), GpuError>| match r {
        Err(GpuError::Invalid(m)) => m,
        other => panic!("expected Invalid, got {other:?}"),
    };
    assert!(mm.encode(g, &mut enc, &w, &x, 0, &y, 0, 2).is_ok());
    let m = enc_err(mm.encode(g, &mut enc, &w, &x, 1, &y, 0, 2));
    assert!(m.contains("activations"), "{m}");
    let m = enc_err(mm.encode(g, &mut enc, &w, &x, 0, &y, 0, 3));
    assert!(m.contains("activations"), "{m}");
    let m = enc_err(mm.encode(g, &mut enc, &w, &x, 0, &y, 1, 2));
    assert!(m.contains("outputs"), "{m}");
    let m = enc_err(mm.encode(g, &mut enc, &w, &x, 0, &x, 0, 1));
    assert!(m.contains("one buffer"), "{m}");
    let u = g.uniform("not storage", &[0; 64]);
    let m = enc_err(mm.encode(g, &mut enc, &w, &x, 0, &u, 0, 1));
    assert!(m.contains("not a storage buffer"), "{m}");
    assert!(mm.encode(g, &mut enc, &w, &x, 0, &y, 0, 0).is_ok());
    g.queue().submit([enc.finish()]);
    g.wait().unwrap();
}

#[test]
fn bench_matvec_reports_time_and_bytes() {
    let (secs, bytes) = bench_matvec(gpu(), GgmlType::Q4_K, 64, 512, 3).unwrap();
    assert!(secs > 0.0 && secs.is_finite());
    assert_eq!(bytes, 64 * 288 + 4 * (64 + 512));
    assert!(synthetic_weights(GgmlType::Q4_K, 1, 100, 1).is_none());
}
