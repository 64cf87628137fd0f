//! Memory read bandwidth probe for the roofline in `ringllm bench`: streams a buffer with the
//! same access pattern as the decode kernels (wide loads, software prefetch ahead), so the
//! figure is the best this machine reads at, not a scalar loop's.

use crate::pool::{Chunks, ThreadPool};
use std::time::Instant;

/// Bytes per chunk handed to a thread.
const CHUNK: usize = 1 << 20;

/// Best read bandwidth (bytes/s) of `pool` streaming `buf` `passes` times.
pub fn read_bandwidth(pool: &ThreadPool, buf: &[u8], passes: usize) -> f64 {
    let mut best = 0f64;
    for _ in 0..passes.max(1) {
        let chunks = Chunks::new(buf.len().div_ceil(CHUNK), 1);
        let sink = std::sync::atomic::AtomicU64::new(0);
        let t0 = Instant::now();
        pool.run(&|_| {
            let mut acc = 0u64;
            while let Some(r) = chunks.next_range() {
                for c in r {
                    let part = &buf[c * CHUNK..((c + 1) * CHUNK).min(buf.len())];
                    acc ^= read(part);
                }
            }
            sink.fetch_xor(acc, std::sync::atomic::Ordering::Relaxed);
        });
        let s = t0.elapsed().as_secs_f64();
        std::hint::black_box(sink.load(std::sync::atomic::Ordering::Relaxed));
        best = best.max(buf.len() as f64 / s);
    }
    best
}

fn read(part: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::avx2::available() {
            // SAFETY: AVX2 was detected just above.
            return unsafe { read_avx2(part) };
        }
    }
    part.chunks_exact(8).fold(0u64, |a, c| {
        a ^ u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_avx2(part: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let p = part.as_ptr();
    let n = part.len() / 128;
    let mut acc = [_mm256_setzero_si256(); 4];
    for i in 0..n {
        // SAFETY: block i of 128 bytes lies inside `part`; prefetch is only a hint.
        unsafe {
            let b = p.add(i * 128);
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(4096).cast());
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_xor_si256(*a, _mm256_loadu_si256(b.add(32 * j).cast()));
            }
        }
    }
    let x = _mm256_xor_si256(
        _mm256_xor_si256(acc[0], acc[1]),
        _mm256_xor_si256(acc[2], acc[3]),
    );
    (_mm256_extract_epi64::<0>(x)
        ^ _mm256_extract_epi64::<1>(x)
        ^ _mm256_extract_epi64::<2>(x)
        ^ _mm256_extract_epi64::<3>(x)) as u64
}
