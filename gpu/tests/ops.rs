//! The GPU layer ops (`ringllm_gpu::ops`) against the CPU: every op on random data and the
//! shapes of both test models (SmolLM2-135M: 9 heads, 3 KV heads, head 64, d 576, interleaved
//! RoPE; Gemma 3 270M: 4 heads, 1 KV head, head 256, d 640, window 512, QK-norm, NeoX RoPE),
//! batches of 1 and 7 rows, with both reduction variants (shared memory, and subgroups when
//! the adapter has them). Oracles: `ringllm_kernels::ops` (the functions the CPU forward pass
//! calls) and, for attention, a plain f64 implementation of the forward pass's attention
//! written here. Runs on whatever adapter wgpu finds (Mesa lavapipe in CI).

use std::sync::OnceLock;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ringllm_gpu::{AttnShape, Glu, Gpu, GpuOptions, KvLayout, Ops, RopeStyle};
use ringllm_kernels::ops;
use wgpu::Buffer;

/// Norm outputs, relative to max(1, |expected|): the GPU sums the squares in a tree (or by
/// subgroups) where the CPU sums in order; over rows of ≤ 2048 values the mean of squares
/// differs by a few f32 ulps (~1e-7 relative), which the scale carries into every output.
const NORM_REL: f32 = 1e-5;
/// Activations (exp, tanh differ by a few ulps between the driver's and Rust's libm), relative
/// to max(1, |expected|).
const ACT_REL: f32 = 1e-5;
/// RoPE: two products and a sum per output, which a GPU may fuse (FMA): ≤ 2 ulps of values
/// below 4 in magnitude.
const ROPE_ABS: f32 = 2e-6;
/// Attention output (a convex combination of values in [-1, 1]): the online softmax rescales
/// partial sums tile by tile and the driver's exp differs by ulps; 1e-4 absolute is ~100× the
/// f32 rounding of a 8k-key softmax, and far below what one wrong key or slot would cause
/// (~1e-2 and up).
const ATTN_ABS: f64 = 1e-4;

/// Marks the elements a kernel must not touch.
const SENTINEL: f32 = -12345.0;

struct Fixture {
    gpu: Gpu,
    /// The shared-memory variant, then the subgroup variant if the adapter has subgroups.
    variants: Vec<Ops>,
}

fn fx() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let gpu = Gpu::open(&GpuOptions {
            allow_software: true,
            ..Default::default()
        })
        .expect("a GPU adapter (install mesa-vulkan-drivers for lavapipe)");
        let t = std::time::Instant::now();
        let mut variants = vec![Ops::with_subgroups(&gpu, false).expect("shared-memory ops")];
        if gpu.summary().subgroups.is_some() {
            variants.push(Ops::with_subgroups(&gpu, true).expect("subgroup ops"));
        }
        println!(
            "adapter: {}; reduction variants: {} (compiled in {:.1?})",
            gpu.summary(),
            variants.len(),
            t.elapsed()
        );
        Fixture { gpu, variants }
    })
}

fn name(o: &Ops) -> &'static str {
    if o.uses_subgroups() {
        "subgroups"
    } else {
        "shared"
    }
}

fn rand_vec(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

fn upload(gpu: &Gpu, data: &[f32]) -> Buffer {
    gpu.storage_init("test", bytemuck::cast_slice(data))
        .unwrap()
}

fn upload_u32(gpu: &Gpu, data: &[u32]) -> Buffer {
    gpu.storage_init("test u32", bytemuck::cast_slice(data))
        .unwrap()
}

fn read(gpu: &Gpu, buf: &Buffer, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; n];
    gpu.read_f32(buf, 0, &mut out).unwrap();
    out
}

/// Records with `f`, submits, waits.
fn run(gpu: &Gpu, f: impl FnOnce(&mut wgpu::CommandEncoder)) {
    let mut enc = gpu
        .device()
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("test"),
        });
    f(&mut enc);
    gpu.queue().submit([enc.finish()]);
    gpu.wait().unwrap();
}

/// Largest |got - want| / max(1, |want|); panics on NaN.
fn max_rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let mut m = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "element {i}: {g} (want {w})");
        m = m.max((g - w).abs() / w.abs().max(1.0));
    }
    m
}

fn max_abs(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let mut m = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "element {i}: {g} (want {w})");
        m = m.max((g - w).abs());
    }
    m
}

fn assert_untouched(v: &[f32], what: &str) {
    assert!(
        v.iter().all(|&x| x == SENTINEL),
        "{what}: elements outside the op's range were written"
    );
}

#[test]
fn rms_norm_matches_cpu() {
    let f = fx();
    let gpu = &f.gpu;
    let mut rng = StdRng::seed_from_u64(1);
    let mut worst = 0.0f32;
    for o in &f.variants {
        for &d in &[576u32, 640, 2048, 100] {
            for &rows in &[1u32, 7] {
                let (x_off, out_off) = (3usize, 5usize);
                let n = rows as usize * d as usize;
                let mut x = rand_vec(&mut rng, x_off + n + 2, 2.0);
                x[x_off] = 40.0; // one large value: the scale must follow it
                let w = rand_vec(&mut rng, d as usize, 1.5);
                let mut want = vec![0.0; n];
                ops::rms_norm_rows(&x[x_off..x_off + n], &w, 1e-6, &mut want);
                let xb = upload(gpu, &x);
                let wb = upload(gpu, &w);
                let ob = upload(gpu, &vec![SENTINEL; out_off + n + 3]);
                run(gpu, |enc| {
                    o.rms_norm(
                        gpu,
                        enc,
                        &xb,
                        x_off as u64,
                        &wb,
                        &ob,
                        out_off as u64,
                        rows,
                        d,
                        1e-6,
                    )
                    .unwrap()
                });
                let got = read(gpu, &ob, out_off + n + 3);
                assert_untouched(&got[..out_off], "rms_norm head");
                assert_untouched(&got[out_off + n..], "rms_norm tail");
                let e = max_rel(&got[out_off..out_off + n], &want);
                assert!(e <= NORM_REL, "{} d {d} rows {rows}: rel err {e}", name(o));
                worst = worst.max(e);
            }
        }
    }
    println!("rms_norm: max rel err {worst:.3e} (budget {NORM_REL:.0e})");
}

#[test]
fn grids_beyond_65535_workgroups_fold_into_two_dimensions() {
    // 70 000 rows: one workgroup each, more than one grid dimension holds.
    let f = fx();
    let gpu = &f.gpu;
    let mut rng = StdRng::seed_from_u64(8);
    let (rows, d) = (70_000u32, 8u32);
    let n = (rows * d) as usize;
    let x = rand_vec(&mut rng, n, 2.0);
    let w = rand_vec(&mut rng, d as usize, 1.0);
    let mut want = vec![0.0; n];
    ops::rms_norm_rows(&x, &w, 1e-5, &mut want);
    for o in &f.variants {
        let (xb, wb) = (upload(gpu, &x), upload(gpu, &w));
        let ob = upload(gpu, &vec![SENTINEL; n]);
        run(gpu, |enc| {
            o.rms_norm(gpu, enc, &xb, 0, &wb, &ob, 0, rows, d, 1e-5)
                .unwrap()
        });
        let e = max_rel(&read(gpu, &ob, n), &want);
        assert!(e <= NORM_REL, "{}: {e}", name(o));
    }
}

#[test]
fn rms_norm_heads_matches_cpu() {
    let f = fx();
    let gpu = &f.gpu;
    let mut rng = StdRng::seed_from_u64(2);
    let mut worst = 0.0f32;
    for o in &f.variants {
        // Gemma 3 270M: Q (4 heads) and K (1 head) of 256, eps 1e-6; and 64-wide heads.
        for &(heads, hd) in &[(4u32, 256u32), (1, 256), (9, 64)] {
            for &rows in &[1u32, 7] {
                let off = 11usize;
                let n = (rows * heads * hd) as usize;
                let mut x = vec![SENTINEL; off];
                x.extend(rand_vec(&mut rng, n, 3.0));
                x.extend([SENTINEL; 4]);
                let w = rand_vec(&mut rng, hd as usize, 2.0);
                let mut want = x[off..off + n].to_vec();
                ops::rms_norm_rows_inplace(&mut want, &w, 1e-6);
                let xb = upload(gpu, &x);
                let wb = upload(gpu, &w);
                run(gpu, |enc| {
                    o.rms_norm_heads(gpu, enc, &xb, off as u64, &wb, rows, heads, hd, 1e-6)
                        .unwrap()
                });
                let got = read(gpu, &xb, x.len());
                assert_untouched(&got[..off], "rms_norm_heads head");
                assert_untouched(&got[off + n..], "rms_norm_heads tail");
                let e = max_rel(&got[off..off + n], &want);
                assert!(
                    e <= NORM_REL,
                    "{} heads {heads}×{hd} rows {rows}: {e}",
                    name(o)
                );
                worst = worst.max(e);
            }
        }
    }
    println!("rms_norm_heads: max rel err {worst:.3e} (budget {NORM_REL:.0e})");
}

#[test]
fn bias_and_residual_match_cpu() {
    let f = fx();
    let gpu = &f.gpu;
    let mut rng = StdRng::seed_from_u64(3);
    let mut worst = 0.0f32;
    for o in &f.variants {
        for &d in &[576u32, 640] {
            for &rows in &[1u32, 7] {
                let n = (rows * d) as usize;
                // Bias: one f32 add per element, exactly as on the CPU.
                let off = 7usize;
                let mut x = vec![SENTINEL; off];
                x.extend(rand_vec(&mut rng, n, 2.0));
                x.push(SENTINEL);
                let b = rand_vec(&mut rng, d as usize, 1.0);
                let mut want = x[off..off + n].to_vec();
                for row in want.chunks_exact_mut(d as usize) {
                    ops::add_inplace(row, &b);
                }
                let xb = upload(gpu, &x);
                let bb = upload(gpu, &b);
                run(gpu, |enc| {
                    o.add_bias(gpu, enc, &xb, off as u64, &bb, rows, d).unwrap()
                });
                let got = read(gpu, &xb, x.len());
                assert_untouched(&got[..off], "add_bias head");
                assert_untouched(&got[off + n..], "add_bias tail");
                assert_eq!(&got[off..off + n], &want[..], "add_bias is exact");

                // Residual, plain (exact) and with Gemma's sandwich norm.
                let x = rand_vec(&mut rng, n, 4.0);
                let y = rand_vec(&mut rng, n, 3.0);
                let w = rand_vec(&mut rng, d as usize, 2.0);
                for post in [false, true] {
                    let mut want = x.clone();
                    let mut yn = y.clone();
                    if post {
                        ops::rms_norm_rows_inplace(&mut yn, &w, 1e-6);
                    }
                    ops::add_inplace(&mut want, &yn);
                    let xb = upload(gpu, &x);
                    let yb = upload(gpu, &y);
                    let wb = upload(gpu, &w);
                    run(gpu, |enc| {
                        o.residual(gpu, enc, &xb, &yb, post.then_some(&wb), rows, d, 1e-6)
                            .unwrap()
                    });
                    let got = read(gpu, &xb, n);
                    if post {
                        let e = max_rel(&got, &want);
                        assert!(e <= NORM_REL, "{} residual+norm d {d}: {e}", name(o));
                        worst = worst.max(e);
                    } else {
                        assert_eq!(got, want, "plain residual is exact");
                    }
                    // The residual's input is not modified.
                    assert_eq!(read(gpu, &yb, n), y);
                }
            }
        }
    }
    println!("add_bias, residual: exact; residual+post-norm: max rel err {worst:.3e}");
}

#[test]
fn glu_and_softcap_match_cpu() {
    let f = fx();
    let gpu = &f.gpu;
    let mut rng = StdRng::seed_from_u64(4);
    let o = &f.variants[0]; // element-wise: no reduction, one variant is enough
    let mut worst = [0.0f32; 3];
    for &len in &[1536u32, 2048 * 7, 77] {
        let mut gate = rand_vec(&mut rng, len as usize, 6.0);
        // Large arguments: tanh and exp must saturate, not overflow to NaN.
        gate[0] = 60.0;
        gate[1] = -60.0;
        gate[2] = 1000.0;
        gate[3] = -1000.0;
        let up = rand_vec(&mut rng, len as usize, 2.0);
        for (k, act) in [Glu::Silu, Glu::GeluTanh].into_iter().enumerate() {
            let mut want = gate.clone();
            let f: fn(f32) -> f32 = match act {
                Glu::Silu => ops::silu,
                Glu::GeluTanh => ops::gelu_tanh,
            };
            ops::glu(&mut want, &up, f);
            let gb = upload(gpu, &gate);
            let ub = upload(gpu, &up);
            run(gpu, |enc| o.glu(gpu, enc, &gb, &ub, len, act).unwrap());
            let e = max_rel(&read(gpu, &gb, len as usize), &want);
            assert!(e <= ACT_REL, "{act:?} len {len}: {e}");
            worst[k] = worst[k].max(e);
        }
        // Soft-capping as the CPU's logits(): cap * tanh(v / cap), cap 30 (Gemma 2's).
        let mut logits = rand_vec(&mut rng, len as usize, 80.0);
        logits[0] = 1e6;
        logits[1] = -1e6;
        let cap = 30.0f32;
        let want: Vec<f32> = logits.iter().map(|v| cap * (v / cap).tanh()).collect();
        let lb = upload(gpu, &logits);
        run(gpu, |enc| o.softcap(gpu, enc, &lb, len, cap).unwrap());
        let got = read(gpu, &lb, len as usize);
        let e = max_rel(&got, &want);
        assert!(e <= ACT_REL, "softcap len {len}: {e}");
        worst[2] = worst[2].max(e);
    }
    println!(
        "glu silu {:.3e}, glu gelu_tanh {:.3e}, softcap {:.3e} max rel err (budget {ACT_REL:.0e})",
        worst[0], worst[1], worst[2]
    );
}

#[test]
fn rope_matches_cpu() {
    let f = fx();
    let gpu = &f.gpu;
    let mut rng = StdRng::seed_from_u64(5);
    let o = &f.variants[0];
    let mut worst = 0.0f32;
    // (heads, hd, rotated dims, base, style): SmolLM2 Q and K, Gemma 3 Q and K (local base
    // 10k, global 1M), and a partial rotation.
    let cases = [
        (9u32, 64u32, 64u32, 100_000.0f32, RopeStyle::Interleaved),
        (3, 64, 64, 100_000.0, RopeStyle::Interleaved),
        (4, 256, 256, 10_000.0, RopeStyle::Neox),
        (1, 256, 256, 1_000_000.0, RopeStyle::Neox),
        (2, 64, 32, 10_000.0, RopeStyle::Neox),
        (2, 64, 32, 10_000.0, RopeStyle::Interleaved),
    ];
    for (heads, hd, rot, base, style) in cases {
        for &(rows, p0) in &[(1u32, 0usize), (1, 8191), (7, 600)] {
            let half = rot / 2;
            let inv = ops::rope_inv_freq(base, rot as usize);
            let mut cs = Vec::new();
            let mut pairs = vec![(0.0f32, 0.0f32); half as usize];
            for r in 0..rows as usize {
                ops::rope_cos_sin(p0 + r, &inv, &mut pairs);
                cs.extend(pairs.iter().flat_map(|&(c, s)| [c, s]));
            }
            let off = 13usize;
            let n = (rows * heads * hd) as usize;
            let mut x = vec![SENTINEL; off];
            x.extend(rand_vec(&mut rng, n, 2.0));
            x.push(SENTINEL);
            let mut want = x[off..off + n].to_vec();
            for (r, row) in want.chunks_exact_mut((heads * hd) as usize).enumerate() {
                let mut rcs = vec![(0.0f32, 0.0f32); half as usize];
                ops::rope_cos_sin(p0 + r, &inv, &mut rcs);
                for head in row.chunks_exact_mut(hd as usize) {
                    ops::rope_apply(head, &rcs, style);
                }
            }
            let xb = upload(gpu, &x);
            let cb = upload(gpu, &cs);
            run(gpu, |enc| {
                o.rope(gpu, enc, &xb, off as u64, &cb, rows, heads, hd, half, style)
                    .unwrap()
            });
            let got = read(gpu, &xb, x.len());
            assert_untouched(&got[..off], "rope head");
            assert_untouched(&got[off + n..], "rope tail");
            let e = max_abs(&got[off..off + n], &want);
            assert!(
                e <= ROPE_ABS,
                "{style:?} {heads}×{hd} rot {rot} rows {rows}: {e}"
            );
            worst = worst.max(e);
        }
    }
    println!("rope: max abs err {worst:.3e} (budget {ROPE_ABS:.0e})");
}

/// A sequence's K and V for positions `0..len` (rows of `kvd`), stored into a device ring of
/// `cap` slots by `kv_store` in batches of at most `batch` rows (from element `kv_off` of
/// a staging buffer), as the forward pass does step by step.
struct Seq {
    k: Vec<f32>,
    v: Vec<f32>,
    kc: Buffer,
    vc: Buffer,
}

#[allow(clippy::too_many_arguments)]
fn fill_cache(
    o: &Ops,
    gpu: &Gpu,
    rng: &mut StdRng,
    len: usize,
    kvd: u32,
    layout: &KvLayout,
    batch: usize,
) -> Seq {
    let kvd_us = kvd as usize;
    let k = rand_vec(rng, len * kvd_us, 1.0);
    let v = rand_vec(rng, len * kvd_us, 1.0);
    let words = layout.cap as usize * kvd_us / if layout.f16 { 2 } else { 1 };
    let kc = gpu.storage("kc", words as u64 * 4).unwrap();
    let vc = gpu.storage("vc", words as u64 * 4).unwrap();
    let kv_off = 5usize;
    let mut p = 0;
    while p < len {
        let n = batch.min(len - p);
        let mut ks = vec![0.0; kv_off];
        ks.extend_from_slice(&k[p * kvd_us..(p + n) * kvd_us]);
        let mut vs = vec![0.0; kv_off];
        vs.extend_from_slice(&v[p * kvd_us..(p + n) * kvd_us]);
        let pos: Vec<u32> = [7u32, 7]
            .into_iter()
            .chain((p..p + n).map(|x| x as u32))
            .collect();
        let (kb, vb, pb) = (upload(gpu, &ks), upload(gpu, &vs), upload_u32(gpu, &pos));
        run(gpu, |enc| {
            o.kv_store(
                gpu,
                enc,
                &kb,
                &vb,
                kv_off as u64,
                &kc,
                &vc,
                &pb,
                2,
                n as u32,
                kvd,
                layout,
            )
            .unwrap()
        });
        p += n;
    }
    Seq { k, v, kc, vc }
}

fn f16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
}

#[test]
fn kv_store_rings_and_rounds_like_the_cpu() {
    let f = fx();
    let gpu = &f.gpu;
    let mut rng = StdRng::seed_from_u64(6);
    let o = &f.variants[0];
    // Gemma's sliding ring (cap 512 + 8 - 1) filled past its size in batches of 7: each slot
    // must hold the newest position that maps to it.
    let kvd = 256u32;
    for f16 in [false, true] {
        let layout = KvLayout {
            cap: 519,
            window: Some(512),
            f16,
        };
        let len = 700;
        let s = fill_cache(o, gpu, &mut rng, len, kvd, &layout, 7);
        let words = (layout.cap * kvd) as usize / if f16 { 2 } else { 1 };
        for (cache, src) in [(&s.kc, &s.k), (&s.vc, &s.v)] {
            let raw = read(gpu, cache, words);
            let got: Vec<f32> = if f16 {
                raw.iter()
                    .flat_map(|w| {
                        let b = w.to_bits();
                        [b as u16, (b >> 16) as u16].map(|h| half::f16::from_bits(h).to_f32())
                    })
                    .collect()
            } else {
                raw
            };
            for slot in 0..layout.cap as usize {
                let p = (0..len)
                    .rev()
                    .find(|p| p % layout.cap as usize == slot)
                    .unwrap();
                let want = &src[p * kvd as usize..(p + 1) * kvd as usize];
                let want = if f16 { f16_round(want) } else { want.to_vec() };
                assert_eq!(
                    &got[slot * kvd as usize..(slot + 1) * kvd as usize],
                    &want[..],
                    "slot {slot} (position {p}), f16 {f16}"
                );
            }
        }
    }
    // Rounding to binary16 is bit-exact with half::f16::from_f32 (nearest even) on the
    // awkward values: ties, subnormals, overflow, infinities, signed zero.
    let mut special = vec![
        0.0f32,
        -0.0,
        1.0,
        -1.0,
        65504.0,
        65519.0,
        65520.0,
        -70000.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1.0 + 1.0 / 2048.0,              // tie, rounds to even (1.0)
        1.0 + 3.0 / 2048.0,              // tie, rounds up
        2f32.powi(-14),                  // smallest normal
        2f32.powi(-14) - 2f32.powi(-24), // largest subnormal
        2f32.powi(-24),                  // smallest subnormal
        2f32.powi(-25),                  // half of it: tie to zero
        0.75 * 2f32.powi(-24),           // rounds up
        1.5 * 2f32.powi(-24),            // tie to even (2 units)
        2.5 * 2f32.powi(-24),            // tie to even (2 units)
        -(2f32.powi(-26)),
        1e-30,
        std::f32::consts::PI,
        -std::f32::consts::E,
    ];
    special.extend((0..1000).map(|i| rng.random_range(-1e-4f32..1e-4) * (i as f32 / 100.0)));
    special.extend((0..1000).map(|_| rng.random_range(-70000.0f32..70000.0)));
    if special.len() % 2 == 1 {
        special.push(0.5);
    }
    let kvd = special.len() as u32;
    let layout = KvLayout {
        cap: 1,
        window: None,
        f16: true,
    };
    let kb = upload(gpu, &special);
    let vb = upload(gpu, &special.iter().map(|x| -x).collect::<Vec<_>>());
    let pb = upload_u32(gpu, &[0]);
    let kc = gpu.storage("kc", kvd as u64 * 2).unwrap();
    let vc = gpu.storage("vc", kvd as u64 * 2).unwrap();
    run(gpu, |enc| {
        o.kv_store(gpu, enc, &kb, &vb, 0, &kc, &vc, &pb, 0, 1, kvd, &layout)
            .unwrap()
    });
    for (cache, sign) in [(&kc, 1.0f32), (&vc, -1.0)] {
        let raw = read(gpu, cache, kvd as usize / 2);
        for (i, w) in raw.iter().enumerate() {
            let b = w.to_bits();
            for (h, x) in [
                (b as u16, special[2 * i]),
                ((b >> 16) as u16, special[2 * i + 1]),
            ] {
                let want = half::f16::from_f32(sign * x).to_bits();
                assert_eq!(h, want, "{} → {h:#06x}, want {want:#06x}", sign * x);
            }
        }
    }
    println!("kv_store: ring slots exact (f32 and f16), f16 rounding bit-exact on {kvd} values");
}

/// The forward pass's attention, plainly, in f64: row at position `p` sees
/// `max(0, p + 1 - window) ..= p`, query head h uses KV head h / group, softmax of the scaled
/// scores, weighted sum of the values. `k`/`v` hold every position's row (`kvd` wide).
#[allow(clippy::too_many_arguments)]
fn attention_oracle(
    q: &[f32],
    positions: &[usize],
    k: &[f32],
    v: &[f32],
    shape: &AttnShape,
    window: Option<usize>,
) -> Vec<f32> {
    let (nh, nkv, hd) = (
        shape.n_head as usize,
        shape.n_head_kv as usize,
        shape.head_dim as usize,
    );
    let (qd, kvd, group) = (nh * hd, nkv * hd, nh / nkv);
    let mut out = vec![0.0f32; positions.len() * qd];
    for (r, &p) in positions.iter().enumerate() {
        let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
        for h in 0..nh {
            let qh = &q[r * qd + h * hd..r * qd + (h + 1) * hd];
            let kh = (h / group) * hd;
            let scores: Vec<f64> = (lo..=p)
                .map(|j| {
                    let kr = &k[j * kvd + kh..j * kvd + kh + hd];
                    qh.iter()
                        .zip(kr)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * shape.scale as f64
                })
                .map(|s| {
                    let c = f64::from(shape.softcap);
                    if c > 0.0 {
                        c * (s / c).tanh()
                    } else {
                        s
                    }
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for d in 0..hd {
                let acc: f64 = (lo..=p)
                    .zip(&e)
                    .map(|(j, w)| w * v[j * kvd + kh + d] as f64)
                    .sum();
                out[r * qd + h * hd + d] = (acc / sum) as f32;
            }
        }
    }
    out
}

struct AttnCase {
    name: &'static str,
    shape: AttnShape,
    layout: KvLayout,
    /// Positions stored in the cache: 0..len.
    len: usize,
    /// Query rows (consecutive positions ending at len - 1).
    rows: u32,
    /// Query amplitude: large values make the softmax peaky (scores of ±20 and more).
    q_amp: f32,
}

fn attention_case(c: &AttnCase) -> f64 {
    let f = fx();
    let gpu = &f.gpu;
    let mut rng = StdRng::seed_from_u64(7 + c.len as u64);
    let mut worst = 0.0f64;
    let kvd = c.shape.n_head_kv * c.shape.head_dim;
    let qd = (c.shape.n_head * c.shape.head_dim) as usize;
    // Every reduction variant, each with attention in one pass per (row, head) (split 0),
    // with keys split every 64 (many workgroups per pair, merged), and the default.
    let mut runs = Vec::new();
    for o in &f.variants {
        for split in [0u32, 64, ringllm_gpu::ops::ATTN_SPLIT_KEYS] {
            let mut o = o.clone();
            o.set_attention_split(split);
            runs.push((o, split));
        }
    }
    // The cache filled once (by kv_store of the first variant), the oracle computed once.
    let batch = (c.layout.cap as usize).min(1024);
    let s = fill_cache(&runs[0].0, gpu, &mut rng, c.len, kvd, &c.layout, batch);
    let (k, v) = if c.layout.f16 {
        (f16_round(&s.k), f16_round(&s.v))
    } else {
        (s.k.clone(), s.v.clone())
    };
    let rows = c.rows as usize;
    let positions: Vec<usize> = (c.len - rows..c.len).collect();
    let q = rand_vec(&mut rng, rows * qd, c.q_amp);
    let t = std::time::Instant::now();
    let want = attention_oracle(
        &q,
        &positions,
        &k,
        &v,
        &c.shape,
        c.layout.window.map(|w| w as usize),
    );
    let oracle_time = t.elapsed();
    let t = std::time::Instant::now();
    for (o, split) in &runs {
        // q at row 3 of its buffer, pos at element 4 of its buffer.
        let q_row = 3u32;
        let mut qbuf = vec![SENTINEL; q_row as usize * qd];
        qbuf.extend(&q);
        qbuf.extend(vec![SENTINEL; qd]);
        let pos: Vec<u32> = [9u32; 4]
            .into_iter()
            .chain(positions.iter().map(|&p| p as u32))
            .collect();
        let (qb, pb) = (upload(gpu, &qbuf), upload_u32(gpu, &pos));
        let ob = upload(gpu, &vec![SENTINEL; qbuf.len()]);
        run(gpu, |enc| {
            o.attention(
                gpu, enc, &qb, &ob, q_row, &s.kc, &s.vc, &pb, 4, c.rows, &c.shape, &c.layout,
            )
            .unwrap()
        });
        let got = read(gpu, &ob, qbuf.len());
        let start = q_row as usize * qd;
        assert_untouched(&got[..start], "attention rows before");
        assert_untouched(&got[start + rows * qd..], "attention rows after");
        let e = max_abs(&got[start..start + rows * qd], &want) as f64;
        assert!(
            e <= ATTN_ABS,
            "{} rows {} len {} ({}, split {split}): abs err {e}",
            c.name,
            c.rows,
            c.len,
            name(o)
        );
        worst = worst.max(e);
    }
    println!(
        "attention {} rows {} len {}: max abs err {worst:.3e} (budget {ATTN_ABS:.0e}); \
         oracle {oracle_time:.1?}, {} GPU runs {:.1?}",
        c.name,
        c.rows,
        c.len,
        runs.len(),
        t.elapsed()
    );
    worst
}

fn smollm2(f16: bool, cap: u32) -> (AttnShape, KvLayout) {
    (
        AttnShape {
            n_head: 9,
            n_head_kv: 3,
            head_dim: 64,
            scale: 1.0 / 8.0,
            softcap: 0.0,
        },
        KvLayout {
            cap,
            window: None,
            f16,
        },
    )
}

/// A Gemma 3 270M sliding layer: window 512, ring of 512 + 8 - 1 (max batch 8).
fn gemma_sliding(f16: bool) -> (AttnShape, KvLayout) {
    (
        AttnShape {
            n_head: 4,
            n_head_kv: 1,
            head_dim: 256,
            scale: 1.0 / 16.0,
            softcap: 0.0,
        },
        KvLayout {
            cap: 519,
            window: Some(512),
            f16,
        },
    )
}

/// Gemma 2's attention logit soft-capping on a sliding layer: a small cap (5, Gemma 2's is 50)
/// and peaky queries, so most scores are bent by the tanh.
#[test]
fn attention_with_logit_softcap_matches_oracle() {
    for f16 in [false, true] {
        for (rows, len) in [(1u32, 40usize), (7, 30)] {
            let (mut shape, mut layout) = gemma_sliding(f16);
            shape.softcap = 5.0;
            layout.window = Some(16);
            layout.cap = 16 + 7;
            attention_case(&AttnCase {
                name: if f16 { "softcap f16" } else { "softcap f32" },
                shape,
                layout,
                len,
                rows,
                q_amp: 8.0,
            });
        }
    }
}

#[test]
fn attention_smollm2_matches_oracle() {
    for f16 in [false, true] {
        for (rows, len) in [(1u32, 1usize), (1, 200), (7, 7), (7, 150)] {
            let (shape, layout) = smollm2(f16, 256);
            attention_case(&AttnCase {
                name: if f16 { "smollm2 f16" } else { "smollm2 f32" },
                shape,
                layout,
                len,
                rows,
                q_amp: 1.0,
            });
        }
    }
}

#[test]
fn attention_gemma_sliding_window_wraps_the_ring() {
    for f16 in [false, true] {
        // 700 positions in a ring of 519: the last rows' windows (189..=699) wrap around it.
        for (rows, len) in [(1u32, 700usize), (7, 700), (7, 300), (1, 513)] {
            let (shape, layout) = gemma_sliding(f16);
            attention_case(&AttnCase {
                name: if f16 {
                    "gemma sliding f16"
                } else {
                    "gemma sliding f32"
                },
                shape,
                layout,
                len,
                rows,
                q_amp: 1.0,
            });
        }
    }
}

#[test]
fn attention_gemma_global_and_peaky_scores() {
    // A Gemma global layer (no window), and queries 40× larger so the scores span ±40: the
    // max-subtracted online softmax must not overflow.
    for f16 in [false, true] {
        let (shape, mut layout) = gemma_sliding(f16);
        layout.window = None;
        layout.cap = 1024;
        attention_case(&AttnCase {
            name: "gemma global peaky",
            shape,
            layout,
            len: 900,
            rows: 7,
            q_amp: 40.0,
        });
    }
}

#[test]
fn attention_long_context_8k() {
    // 8300 positions of SmolLM2 in one context: 130 key tiles, nothing sized by context.
    let (shape, layout) = smollm2(false, 8320);
    attention_case(&AttnCase {
        name: "smollm2 8300 ctx",
        shape,
        layout,
        len: 8300,
        rows: 2,
        q_amp: 1.0,
    });
}

#[test]
fn bad_arguments_are_errors_and_the_device_keeps_working() {
    let f = fx();
    let gpu = &f.gpu;
    let o = &f.variants[0];
    let x = upload(gpu, &[1.0; 64]);
    let w = upload(gpu, &[1.0; 64]);
    let small = upload(gpu, &[0.0; 16]);
    let mut enc = gpu
        .device()
        .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
    let e = o
        .rms_norm(gpu, &mut enc, &x, 0, &w, &small, 0, 1, 64, 1e-6)
        .unwrap_err();
    assert!(
        e.to_string().contains("rms_norm") && e.to_string().contains("out"),
        "{e}"
    );
    let e = o
        .rms_norm(gpu, &mut enc, &x, 0, &w, &x, 0, 1, 64, 1e-6)
        .unwrap_err();
    assert!(e.to_string().contains("different buffers"), "{e}");
    let shape = AttnShape {
        n_head: 2,
        n_head_kv: 1,
        head_dim: 1024,
        scale: 1.0,
        softcap: 0.0,
    };
    let layout = KvLayout {
        cap: 4,
        window: None,
        f16: false,
    };
    let e = o
        .attention(
            gpu, &mut enc, &x, &w, 0, &small, &small, &small, 0, 1, &shape, &layout,
        )
        .unwrap_err();
    assert!(e.to_string().contains("head width"), "{e}");
    let e = o
        .kv_store(
            gpu,
            &mut enc,
            &x,
            &x,
            0,
            &w,
            &small,
            &small,
            0,
            1,
            3,
            &KvLayout {
                f16: true,
                ..layout
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("even kvd"), "{e}");
    let e = o.softcap(gpu, &mut enc, &x, 64, 0.0).unwrap_err();
    assert!(e.to_string().contains("cap"), "{e}");
    // Nothing invalid was recorded: the encoder still submits and the device still works.
    o.softcap(gpu, &mut enc, &x, 64, 0.5).unwrap();
    gpu.queue().submit([enc.finish()]);
    gpu.wait().unwrap();
    let got = read(gpu, &x, 64);
    assert!(
        got.iter()
            .all(|&v| (v - 0.5 * (2.0f32).tanh()).abs() < 1e-6),
        "{got:?}"
    );
}

#[test]
fn attention_other_head_groupings() {
    // Workgroups take up to 4 query heads of a KV head: 6 per KV head (blocks of 4 and 2),
    // plain multi-head (1 per KV head), and the widest head (512) with a width that is not a
    // multiple of the workgroup (96).
    for (n_head, n_head_kv, head_dim, rows, len) in [
        (12u32, 2u32, 128u32, 7u32, 300usize),
        (4, 4, 96, 1, 200),
        (2, 1, 512, 3, 130),
    ] {
        for f16 in [false, true] {
            attention_case(&AttnCase {
                name: "other grouping",
                shape: AttnShape {
                    n_head,
                    n_head_kv,
                    head_dim,
                    scale: 1.0 / (head_dim as f32).sqrt(),
                    softcap: 0.0,
                },
                layout: KvLayout {
                    cap: 320,
                    window: None,
                    f16,
                },
                len,
                rows,
                q_amp: 2.0,
            });
        }
    }
}
