//! Decode-kernel probe: one thread, one activation row against a weight matrix of random
//! blocks (real scales), in cache (512 KiB, repeated) and from DRAM (`MB`, default 256), next
//! to the read bandwidth probe `ringllm bench` uses for its roofline. Nanoseconds a block in
//! cache is the kernel's compute cost; the DRAM figure is what decode sees. A measuring aid
//! (docs/speed.md), not a test. `RINGLLM_ISA` picks the kernel level. Through `matmul` on one
//! thread, so the activation's quantization is in the figure (one row: small); formats with a
//! repacked layout are measured in both.
//!
//!     cargo run --release -p ringllm-kernels --example decode_probe -- [TYPE] [MB]
use ringllm_kernels::{
    bandwidth, kernels, matmul, repack, ActBuffer, GgmlType, QMatrix, ThreadPool,
};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map(String::as_str).unwrap_or("Q4_K");
    let Some(ty) = GgmlType::from_name(name).filter(|t| !t.is_float()) else {
        eprintln!("decode_probe: {name:?} is not a quantized weight type (Q4_K, Q6_K, IQ4_XS...)");
        std::process::exit(2);
    };
    let big_mb: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(256);
    let n_in = 4096;
    let k = kernels(ty);
    let Some(rb) = ty.row_bytes(n_in) else {
        eprintln!("decode_probe: {name} rows of {n_in} do not divide into blocks");
        std::process::exit(2);
    };
    // activations
    let x: Vec<f32> = (0..n_in)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let at = k.vec_dot_type;
    let mut a = vec![0u8; at.row_bytes(n_in).unwrap_or(0)];
    (kernels(at).quantize)(&x, &mut a);
    let make = |bytes: usize| {
        let rows = bytes / rb;
        let mut w = vec![0u8; rows * rb];
        let mut s = 0x1234_5678_9abc_def0u64;
        for b in w.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *b = s as u8;
        }
        // tame the f16 scales: quantize a real row and copy its header bytes into each block
        let mut q = vec![0u8; rb];
        (k.quantize)(&x, &mut q);
        let bb = ty.type_size();
        for r in 0..rows {
            for blk in 0..rb / bb {
                let o = r * rb + blk * bb;
                let hdr = if matches!(ty, GgmlType::Q6_K) {
                    bb - 2..bb
                } else {
                    0..4.min(bb)
                };
                for i in hdr {
                    w[o + i] = q[blk * bb + i];
                }
            }
        }
        (w, rows)
    };
    let pool = ThreadPool::new(1);
    let buf = vec![1u8; big_mb << 20];
    let bw = bandwidth::read_bandwidth(&pool, &buf, 3);
    drop(buf);
    // The repacked layout too, where this level's kernels read one (`run`'s default).
    let layouts: &[bool] = if repack::available(ty) {
        &[false, true]
    } else {
        &[false]
    };
    for (label, bytes, reps, panels) in
        [("L2", 512usize << 10, 2000usize), ("DRAM", big_mb << 20, 6)]
            .into_iter()
            .flat_map(|(l, b, r)| layouts.iter().map(move |&p| (l, b, r, p)))
    {
        let (w, rows) = make(bytes);
        let (w, rows) = if panels {
            let rows = rows - rows % repack::ALIGN;
            let mut p = vec![0u8; rows * rb];
            repack::repack(ty, n_in, rows, &w[..rows * rb], &mut p);
            (p, rows)
        } else {
            (w, rows)
        };
        let m = QMatrix {
            ty,
            n_in,
            n_out: rows,
            data: &w,
            packed: panels,
        };
        let mut acts = ActBuffer::new();
        let mut out = vec![0f32; rows];
        let mut best = f64::MAX;
        for _ in 0..reps.max(3) {
            let t = Instant::now();
            let it = if label == "L2" { 50 } else { 1 };
            for _ in 0..it {
                matmul(&pool, &m, &x, 1, &mut out, &mut acts);
            }
            best = best.min(t.elapsed().as_secs_f64() / it as f64);
            std::hint::black_box(&out);
        }
        let gbs = (rows * rb) as f64 / best / 1e9;
        let blocks = (rows * rb / ty.type_size()) as f64;
        println!(
            "{}{} {label}: {:.2} GB/s  {:.2} ns/block  (read bw {:.2} GB/s, ratio {:.2})",
            ty.name(),
            if panels { " panels" } else { "" },
            gbs,
            best * 1e9 / blocks,
            bw / 1e9,
            gbs * 1e9 / bw
        );
    }
}
