//! Machine facts a node reports: memory, resident set size, CPU features, and a measured
//! matrix × vector speed (the planner's input, measured rather than assumed).

use ringllm_kernels::matmul::{matmul, ActBuffer, QMatrix};
use ringllm_kernels::{kernels, GgmlType, ThreadPool};
use std::time::{Duration, Instant};

/// (total, available) memory in bytes from /proc/meminfo (0, 0 when unreadable).
pub fn memory() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// Gives memory the allocator holds but no longer uses back to the system. glibc keeps freed
/// blocks (a finished session's scratch buffers, tens of MiB) in its arenas, where they stay
/// resident and charged to the process's cgroup: a node would report that much less room to
/// the next coordinator, and refuse an assignment it has room for. Called where memory was
/// given up or is about to be checked (a session's end, a hello, an assignment), not on every
/// budget reading: it takes each arena's lock in turn. Elsewhere than glibc a no-op.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers; it only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Resident set size of this process in bytes (0 when unreadable).
pub fn rss_bytes() -> u64 {
    let text = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages = text
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    pages * 4096
}

/// CPU features the kernels care about.
pub fn cpu_features() -> Vec<String> {
    #[allow(unused_mut)] // nothing is pushed on other architectures
    let mut v = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! f {
            ($($name:tt),*) => {$(
                if std::arch::is_x86_feature_detected!($name) { v.push($name.to_string()); }
            )*};
        }
        f!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vnni"
        );
    }
    #[cfg(target_arch = "aarch64")]
    {
        macro_rules! f {
            ($($name:tt),*) => {$(
                if std::arch::is_aarch64_feature_detected!($name) { v.push($name.to_string()); }
            )*};
        }
        f!("neon", "fp16", "dotprod", "i8mm", "bf16", "sve", "sve2");
    }
    v
}

/// Bytes of quantized weights a `threads`-thread matrix × vector reads per second: a Q8_0
/// matrix of `rows × 2048`, multiplied for at least `budget`. Best of the passes.
pub fn matvec_speed(threads: usize, budget: Duration) -> f64 {
    let (rows, cols) = (2048usize, 2048usize);
    let ty = GgmlType::Q8_0;
    let src: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
        .collect();
    let row_bytes = cols / 32 * 34;
    let mut data = vec![0u8; rows * row_bytes];
    for r in 0..rows {
        (kernels(ty).quantize)(
            &src[r * cols..(r + 1) * cols],
            &mut data[r * row_bytes..(r + 1) * row_bytes],
        );
    }
    let w = QMatrix {
        ty,
        n_in: cols,
        n_out: rows,
        data: &data,
        packed: false,
    };
    let x: Vec<f32> = (0..cols).map(|i| (i % 13) as f32 * 0.1).collect();
    let mut out = vec![0f32; rows];
    let mut acts = ActBuffer::new();
    acts.reserve(cols, 1);
    let pool = ThreadPool::new(threads.max(1));
    let start = Instant::now();
    let mut best = 0f64;
    while start.elapsed() < budget || best == 0.0 {
        let t = Instant::now();
        for _ in 0..8 {
            matmul(&pool, &w, &x, 1, &mut out, &mut acts);
        }
        let s = t.elapsed().as_secs_f64();
        best = best.max(8.0 * data.len() as f64 / s.max(1e-9));
    }
    best
}

/// Bytes free for an unprivileged user on the filesystem holding `path` (`None` when it
/// cannot be asked).
pub fn disk_free(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path that outlives the call, and `st` points to memory
    // for one `statvfs`, which the call fills when it returns 0 (and only then is it read).
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    // The field types differ between targets (u32 on some 32-bit ones).
    #[allow(clippy::unnecessary_cast)]
    let (blocks, size) = (st.f_bavail as u64, st.f_frsize as u64);
    Some(blocks.saturating_mul(size))
}

/// The CPU's model name (from /proc/cpuinfo; "unknown CPU" when it does not say).
pub fn cpu_model() -> String {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("model name") || l.starts_with("Model"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "unknown CPU".to_string())
}

/// Size of the largest cache level CPU 0 sees (the L3, where there is one), in bytes, and
/// its level; `None` when sysfs does not say.
pub fn last_level_cache() -> Option<(u32, u64)> {
    let base = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best: Option<(u32, u64)> = None;
    for e in std::fs::read_dir(base).ok()?.flatten() {
        let read = |f: &str| std::fs::read_to_string(e.path().join(f)).ok();
        let (Some(level), Some(size)) = (read("level"), read("size")) else {
            continue;
        };
        let Ok(level) = level.trim().parse::<u32>() else {
            continue;
        };
        let size = size.trim();
        let (num, mult) = match size.strip_suffix('K') {
            Some(n) => (n, 1u64 << 10),
            None => match size.strip_suffix('M') {
                Some(n) => (n, 1 << 20),
                None => (size, 1),
            },
        };
        let Ok(n) = num.parse::<u64>() else { continue };
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, n * mult));
        }
    }
    best
}

/// "CPU model, L3 480 MiB" for reports.
pub fn machine_summary() -> String {
    let cache = match last_level_cache() {
        Some((level, bytes)) if bytes >= 1 << 20 => format!("L{level} {} MiB", bytes >> 20),
        Some((level, bytes)) => format!("L{level} {} KiB", bytes >> 10),
        None => "cache size unknown".to_string(),
    };
    format!(
        "{}, {cache}, {} CPUs",
        cpu_model(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    )
}
