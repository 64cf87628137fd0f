//! Helpers the protocol's integration tests share: keys, runtimes, payloads, frames, and
//! guards that turn a hang into a failure. Each test file uses a subset.
#![allow(dead_code)]

use ringllm_protocol::{ClusterKey, Dtype, FrameHeader, FrameKind};
use std::sync::mpsc;
use std::time::Duration;

/// A cluster key from a short text.
pub fn key(s: &str) -> ClusterKey {
    ClusterKey::from_bytes(s.as_bytes()).unwrap()
}

/// A multi-threaded tokio runtime with `workers` worker threads.
pub fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap()
}

/// `len` pseudo-random bytes from `seed` (xorshift): different seeds give different
/// payloads, so a frame delivered in place of another is caught.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A hidden-state frame header for `payload` (one token at position `seq`).
pub fn data_frame(seq: u64, payload: &[u8]) -> FrameHeader {
    FrameHeader::new(
        FrameKind::Hidden,
        Dtype::F16,
        seq,
        seq as u32,
        1,
        0,
        payload,
    )
    .unwrap()
}

/// Runs `f` on its own thread and fails the test if it takes longer than `limit` (a hang
/// becomes a failure naming `what`); a panic inside `f` is re-raised as is.
pub fn within_named<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => {
            let _ = h.join();
            v
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: no result within {limit:?} (hung?)")
        }
        // The body panicked: re-raise its panic.
        Err(mpsc::RecvTimeoutError::Disconnected) => match h.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => panic!("{what}: the test thread ended without a result"),
        },
    }
}

/// `within_named` for a whole test.
pub fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    within_named("test", limit, f)
}

/// The `p` quantile (0..=1) of sorted durations.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}
