//! Limits on the sizes a user or a peer supplies — threads, batch, context, KV slots — and
//! the memory check made before anything that large is allocated. A setting above its limit,
//! or an allocation larger than the memory this process may use, is an error naming the
//! setting, its value and the limit, never an abort in the allocator. The coordinator checks
//! its own settings and the node checks every assignment again, since either side may be the
//! one that is wrong.

use crate::arch::Hparams;
use crate::kv::{KvCache, KvType};

/// Most worker threads a runner takes: far above any home machine's cores.
pub const MAX_THREADS: usize = 1024;
/// Most tokens in one batch (a prefill chunk, or every sequence's rows of a serving step).
pub const MAX_BATCH: usize = 65_536;
/// Most context positions: beyond every model ringllm runs.
pub const MAX_CTX: usize = 1 << 21;
/// Most sequences a node keeps a KV cache for at once.
pub const MAX_SLOTS: usize = 4096;

/// Why a size was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// A setting of 0 where at least 1 is needed.
    #[error("{what} must be at least 1")]
    Zero { what: &'static str },
    /// A setting above its hard limit.
    #[error("{what} {value} is more than ringllm accepts (at most {max})")]
    TooLarge {
        what: &'static str,
        value: u64,
        max: u64,
    },
    /// An allocation larger than the memory available to this process.
    #[error(
        "{what} needs {} but only {} is available here; lower the context, batch or \
         slots (or free memory)",
        mib(*need),
        mib(*available)
    )]
    Memory {
        what: String,
        need: u64,
        available: u64,
    },
}

fn mib(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// `value` if it is between 1 and `max`.
pub fn check(what: &'static str, value: usize, max: usize) -> Result<usize, LimitError> {
    if value == 0 {
        return Err(LimitError::Zero { what });
    }
    if value > max {
        return Err(LimitError::TooLarge {
            what,
            value: value as u64,
            max: max as u64,
        });
    }
    Ok(value)
}

/// Bytes this process may still allocate: the machine's available memory, or less when a
/// cgroup (v2) memory limit is closer. `None` when neither can be read.
pub fn available_memory() -> Option<u64> {
    let (_, avail) = crate::sys::memory();
    let machine = (avail > 0).then_some(avail);
    let cgroup = cgroup_headroom();
    match (machine, cgroup) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

/// `memory.max − memory.current` of this process's cgroup (v2), when it has a limit.
fn cgroup_headroom() -> Option<u64> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cg.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let max = read("memory.max")?.trim().parse::<u64>().ok()?;
    let current = read("memory.current")?.trim().parse::<u64>().ok()?;
    Some(max.saturating_sub(current))
}

/// Refuses `need` bytes for `what` when they exceed the memory available (allowed when the
/// available memory cannot be read).
pub fn check_memory(what: impl Into<String>, need: u64) -> Result<(), LimitError> {
    match available_memory() {
        Some(available) if need > available => Err(LimitError::Memory {
            what: what.into(),
            need,
            available,
        }),
        _ => Ok(()),
    }
}

/// Checks a runner's and its KV caches' settings and memory before they are allocated:
/// `threads`, `max_batch` and `ctx` within their limits, `slots` caches of `ctx` positions
/// over `layers`, and the scratch buffers, together within the available memory.
pub fn check_runner(
    hp: &Hparams,
    layers: std::ops::Range<usize>,
    threads: usize,
    max_batch: usize,
    ctx: usize,
    kv: KvType,
    slots: usize,
) -> Result<(), LimitError> {
    check("threads", threads, MAX_THREADS)?;
    check("batch size", max_batch, MAX_BATCH)?;
    check("context size", ctx, MAX_CTX)?;
    check("KV slots", slots, MAX_SLOTS)?;
    let scratch = crate::forward::Runner::scratch_bytes(hp, threads, max_batch, ctx);
    let cache = KvCache::bytes_for(hp, layers, ctx, max_batch, kv) as u64;
    let need = scratch.saturating_add(cache.saturating_mul(slots as u64));
    check_memory(
        format!(
            "a batch of {max_batch} tokens and {slots} KV cache(s) of {ctx} positions ({} \
             scratch, {} cache)",
            mib(scratch),
            mib(cache.saturating_mul(slots as u64))
        ),
        need,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_outside_their_limits_are_named() {
        assert_eq!(check("threads", 4, MAX_THREADS), Ok(4));
        assert_eq!(
            check("threads", 0, MAX_THREADS),
            Err(LimitError::Zero { what: "threads" })
        );
        let e = check("threads", u32::MAX as usize, MAX_THREADS).unwrap_err();
        assert_eq!(
            e.to_string(),
            "threads 4294967295 is more than ringllm accepts (at most 1024)"
        );
    }

    #[test]
    fn more_memory_than_the_machine_has_is_refused() {
        let avail = available_memory().expect("/proc/meminfo is readable on Linux");
        assert!(check_memory("a little", 1 << 20).is_ok());
        let e = check_memory("everything twice", avail.saturating_mul(2)).unwrap_err();
        assert!(e.to_string().starts_with("everything twice needs"), "{e}");
    }
}
