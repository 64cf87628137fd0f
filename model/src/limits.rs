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
/// cgroup memory limit (v1 or v2, this process's group or any group above it) is closer.
/// `None` when neither can be read.
pub fn available_memory() -> Option<u64> {
    budget(None)
}

/// A node's memory budget: the smallest of `cap` (`ringllm node --memory`, less what this
/// process already holds), the machine's available memory (MemAvailable) and the headroom
/// under its cgroup limits (`limit − usage`, v1 and v2). `None` when none is known.
pub fn budget(cap: Option<u64>) -> Option<u64> {
    let (_, avail) = crate::sys::memory();
    let machine = (avail > 0).then_some(avail);
    let flag = cap.map(|c| c.saturating_sub(crate::sys::rss_bytes()));
    smallest([flag, machine, cgroup_headroom()])
}

fn smallest<const N: usize>(v: [Option<u64>; N]) -> Option<u64> {
    v.into_iter().flatten().min()
}

/// The headroom under this process's cgroup memory limits, v1 and v2, when one is set.
pub fn cgroup_headroom() -> Option<u64> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let fs = RealFs;
    let v1 = Cgroup::V1.headroom(&fs, &groups, &mounts);
    let v2 = Cgroup::V2.headroom(&fs, &groups, &mounts);
    for c in [Cgroup::V1, Cgroup::V2] {
        if let Some(group) = c.unreadable(&fs, &groups, &mounts) {
            tracing::warn!(
                "this process is in memory cgroup {group}, whose hierarchy is not mounted here \
                 (`ip netns exec` remounts /sys, for one): its limit cannot be read, so the \
                 budget ignores it; give --memory"
            );
        }
    }
    smallest([v1, v2])
}

/// A v1 limit at or above this is "no limit" (the kernel writes `PAGE_COUNTER_MAX` pages).
const V1_UNLIMITED: u64 = 1 << 62;

/// The two cgroup memory interfaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cgroup {
    /// `memory` controller: `memory.limit_in_bytes`, `memory.usage_in_bytes`.
    V1,
    /// Unified hierarchy: `memory.max`, `memory.current`.
    V2,
}

/// Reads a cgroup file (a trait so tests can give a tree of their own).
trait CgroupFs {
    fn read(&self, path: &std::path::Path) -> Option<String>;
}

struct RealFs;

impl CgroupFs for RealFs {
    fn read(&self, path: &std::path::Path) -> Option<String> {
        std::fs::read_to_string(path).ok()
    }
}

impl Cgroup {
    fn files(self) -> (&'static str, &'static str) {
        match self {
            Cgroup::V1 => ("memory.limit_in_bytes", "memory.usage_in_bytes"),
            Cgroup::V2 => ("memory.max", "memory.current"),
        }
    }

    /// This process's group path from `/proc/self/cgroup`: the line whose controllers
    /// include `memory` (v1), or the `0::` line (v2).
    fn group_path(self, proc_cgroup: &str) -> Option<&str> {
        proc_cgroup.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
            let ours = match self {
                Cgroup::V1 => controllers.split(',').any(|c| c == "memory"),
                Cgroup::V2 => id == "0" && controllers.is_empty(),
            };
            ours.then_some(path.trim())
        })
    }

    /// This process's group when it is not the root group yet the hierarchy is nowhere to be
    /// read (not in `mountinfo`, and no `cgroup.procs` at the usual place).
    fn unreadable(self, fs: &dyn CgroupFs, proc_cgroup: &str, mountinfo: &str) -> Option<String> {
        let path = self.group_path(proc_cgroup)?;
        if path == "/" || path.is_empty() || self.mount(mountinfo).is_some() {
            return None;
        }
        let usual = match self {
            Cgroup::V1 => "/sys/fs/cgroup/memory/cgroup.procs",
            Cgroup::V2 => "/sys/fs/cgroup/cgroup.procs",
        };
        fs.read(std::path::Path::new(usual))
            .is_none()
            .then(|| path.to_string())
    }

    /// Where the hierarchy is mounted, from `/proc/self/mountinfo`: (root of the mount
    /// inside the hierarchy, mount point).
    fn mount(self, mountinfo: &str) -> Option<(String, std::path::PathBuf)> {
        mountinfo.lines().find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let pre: Vec<&str> = pre.split_whitespace().collect();
            let mut post = post.split_whitespace();
            let (fstype, _source, opts) = (post.next()?, post.next()?, post.next().unwrap_or(""));
            let ours = match self {
                Cgroup::V1 => fstype == "cgroup" && opts.split(',').any(|o| o == "memory"),
                Cgroup::V2 => fstype == "cgroup2",
            };
            (ours && pre.len() >= 5).then(|| (pre[3].to_string(), pre[4].into()))
        })
    }

    /// The group's inactive file pages from `memory.stat` (v1 counts its sub-groups under
    /// `total_inactive_file`; v2's `inactive_file` includes them), 0 when unreadable.
    fn inactive_file(self, fs: &dyn CgroupFs, dir: &std::path::Path) -> u64 {
        let key = match self {
            Cgroup::V1 => "total_inactive_file",
            Cgroup::V2 => "inactive_file",
        };
        fs.read(&dir.join("memory.stat"))
            .and_then(|t| {
                t.lines().find_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    (k == key).then(|| v.trim().parse::<u64>().ok())?
                })
            })
            .unwrap_or(0)
    }

    /// `limit − (usage − inactive file pages)` of this process's group and every group above
    /// it up to the mount point, the smallest; `None` when no group on the way has a limit.
    fn headroom(self, fs: &dyn CgroupFs, proc_cgroup: &str, mountinfo: &str) -> Option<u64> {
        let path = self.group_path(proc_cgroup)?;
        let (root, mount) = self.mount(mountinfo).unwrap_or_else(|| {
            let m = match self {
                Cgroup::V1 => "/sys/fs/cgroup/memory",
                Cgroup::V2 => "/sys/fs/cgroup",
            };
            ("/".to_string(), m.into())
        });
        // A mount of a sub-tree (as in a container) shows paths below its root.
        let rel = path
            .strip_prefix(root.trim_end_matches('/'))
            .unwrap_or(path)
            .trim_start_matches('/');
        let (limit_file, usage_file) = self.files();
        let mut dir = mount.join(rel);
        let mut best: Option<u64> = None;
        loop {
            let limit = fs.read(&dir.join(limit_file)).and_then(|t| {
                let t = t.trim();
                // v2 writes "max" for no limit; v1 a number near 2^63.
                t.parse::<u64>().ok().filter(|&l| l < V1_UNLIMITED)
            });
            if let Some(limit) = limit {
                let used = fs
                    .read(&dir.join(usage_file))
                    .and_then(|t| t.trim().parse::<u64>().ok())
                    .unwrap_or(0);
                // Page cache nobody has touched lately (a slice file written, or read once
                // to check it) is charged to the group but goes first under pressure: it
                // is room, as the kernel's own "working set" counts it.
                let idle = self.inactive_file(fs, &dir).min(used);
                let room = limit.saturating_sub(used - idle);
                best = Some(best.map_or(room, |b| b.min(room)));
            }
            if dir == mount || !dir.pop() || !dir.starts_with(&mount) {
                break;
            }
        }
        best
    }
}

/// Refuses `need` bytes for `what` when they exceed the memory available (allowed when the
/// available memory cannot be read).
pub fn check_memory(what: impl Into<String>, need: u64) -> Result<(), LimitError> {
    check_memory_within(None, what, need)
}

/// [`check_memory`] against [`budget`]`(cap)`: a node started with `--memory` passes it.
pub fn check_memory_within(
    cap: Option<u64>,
    what: impl Into<String>,
    need: u64,
) -> Result<(), LimitError> {
    match budget(cap) {
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
    let (what, need) = runner_memory(hp, layers, threads, max_batch, ctx, kv, slots);
    check_memory(what, need)
}

/// What a runner and `slots` KV caches allocate: a description naming the settings, and the
/// bytes (scratch for a batch of `max_batch` tokens + the caches of `ctx` positions).
pub fn runner_memory(
    hp: &Hparams,
    layers: std::ops::Range<usize>,
    threads: usize,
    max_batch: usize,
    ctx: usize,
    kv: KvType,
    slots: usize,
) -> (String, u64) {
    let scratch = crate::forward::Runner::scratch_bytes(hp, threads, max_batch, ctx);
    let cache =
        (KvCache::bytes_for(hp, layers, ctx, max_batch, kv) as u64).saturating_mul(slots as u64);
    let what = format!(
        "a batch of {max_batch} tokens and {slots} KV cache(s) of {ctx} positions ({} \
         scratch, {} cache)",
        mib(scratch),
        mib(cache)
    );
    (what, scratch.saturating_add(cache))
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

    /// A cgroup tree in memory: path → contents.
    struct FakeFs(std::collections::HashMap<std::path::PathBuf, String>);

    impl CgroupFs for FakeFs {
        fn read(&self, path: &std::path::Path) -> Option<String> {
            self.0.get(path).cloned()
        }
    }

    fn fake(files: &[(&str, &str)]) -> FakeFs {
        FakeFs(
            files
                .iter()
                .map(|(p, c)| (p.into(), c.to_string()))
                .collect(),
        )
    }

    const V1_MOUNTS: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const V1_GROUPS: &str = "9:name=systemd:/\n4:memory:/jobs/node1\n1:cpu,cpuacct:/\n0::/\n";

    #[test]
    fn group_paths_and_mounts_come_from_proc() {
        assert_eq!(Cgroup::V1.group_path(V1_GROUPS), Some("/jobs/node1"));
        assert_eq!(Cgroup::V2.group_path(V1_GROUPS), Some("/"));
        // "name=systemd" or "cpu,cpuacct" are not the memory controller.
        assert_eq!(Cgroup::V1.group_path("1:cpu,cpuacct:/a\n"), None);
        assert_eq!(
            Cgroup::V1.mount(V1_MOUNTS),
            Some(("/".to_string(), "/sys/fs/cgroup/memory".into()))
        );
        assert_eq!(
            Cgroup::V2.mount(V1_MOUNTS),
            Some(("/".to_string(), "/sys/fs/cgroup/unified".into()))
        );
    }

    /// In a group whose hierarchy is not mounted (as under `ip netns exec`, which remounts
    /// /sys), the limit cannot be read: said, not silently skipped.
    #[test]
    fn a_group_whose_hierarchy_is_not_mounted_is_reported() {
        let none = fake(&[]);
        let sysfs_only = "22 1 0:20 / /sys rw - sysfs sysfs rw\n";
        assert_eq!(
            Cgroup::V1.unreadable(&none, V1_GROUPS, sysfs_only),
            Some("/jobs/node1".to_string())
        );
        assert_eq!(Cgroup::V1.headroom(&none, V1_GROUPS, sysfs_only), None);
        // The root group, or a mounted hierarchy, is not reported.
        assert_eq!(Cgroup::V2.unreadable(&none, V1_GROUPS, sysfs_only), None);
        assert_eq!(Cgroup::V1.unreadable(&none, V1_GROUPS, V1_MOUNTS), None);
        // Mounted at the usual place without a mountinfo line (a bind mount): readable.
        let usual = fake(&[("/sys/fs/cgroup/memory/cgroup.procs", "1\n")]);
        assert_eq!(Cgroup::V1.unreadable(&usual, V1_GROUPS, sysfs_only), None);
    }

    #[test]
    fn v1_headroom_is_the_tightest_group_on_the_way_up() {
        let m = "/sys/fs/cgroup/memory";
        let fs = fake(&[
            // No limit at the top (the kernel's PAGE_COUNTER_MAX), none set on "jobs".
            (
                &format!("{m}/memory.limit_in_bytes"),
                "9223372036854771712\n",
            ),
            (&format!("{m}/memory.usage_in_bytes"), "5000000000\n"),
            (
                &format!("{m}/jobs/memory.limit_in_bytes"),
                "9223372036854771712\n",
            ),
            (&format!("{m}/jobs/memory.usage_in_bytes"), "900000000\n"),
            // The node's own group: 400 MiB, 10 MiB used.
            (
                &format!("{m}/jobs/node1/memory.limit_in_bytes"),
                "419430400\n",
            ),
            (
                &format!("{m}/jobs/node1/memory.usage_in_bytes"),
                "10485760\n",
            ),
        ]);
        assert_eq!(
            Cgroup::V1.headroom(&fs, V1_GROUPS, V1_MOUNTS),
            Some(390 << 20)
        );
        // A parent closer to its limit than the node's group is the budget.
        let mut fs = fs;
        fs.0.insert(
            format!("{m}/jobs/memory.limit_in_bytes").into(),
            "1000000000".into(),
        );
        assert_eq!(
            Cgroup::V1.headroom(&fs, V1_GROUPS, V1_MOUNTS),
            Some(100_000_000)
        );
        // v1 credits the hierarchical inactive file pages, not the group's own line.
        fs.0.insert(
            format!("{m}/jobs/node1/memory.stat").into(),
            "inactive_file 1\ntotal_inactive_file 5000000\n".into(),
        );
        assert_eq!(
            Cgroup::V1.headroom(&fs, V1_GROUPS, V1_MOUNTS),
            Some(100_000_000)
        );
        fs.0.insert(
            format!("{m}/jobs/memory.stat").into(),
            "total_inactive_file 50000000\n".into(),
        );
        assert_eq!(
            Cgroup::V1.headroom(&fs, V1_GROUPS, V1_MOUNTS),
            Some(150_000_000)
        );
        fs.0.remove(std::path::Path::new(&format!("{m}/jobs/memory.stat")));
        fs.0.remove(std::path::Path::new(&format!("{m}/jobs/node1/memory.stat")));
        // Usage over the limit (page cache charged before the limit was lowered) is 0.
        fs.0.insert(
            format!("{m}/jobs/node1/memory.usage_in_bytes").into(),
            "500000000".into(),
        );
        assert_eq!(Cgroup::V1.headroom(&fs, V1_GROUPS, V1_MOUNTS), Some(0));
        // No v2 limit anywhere: "max", or files absent.
        assert_eq!(Cgroup::V2.headroom(&fs, V1_GROUPS, V1_MOUNTS), None);
    }

    #[test]
    fn v2_headroom_reads_max_and_current() {
        let mounts = "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let groups = "0::/system.slice/node.service\n";
        let g = "/sys/fs/cgroup/system.slice/node.service";
        let fs = fake(&[
            ("/sys/fs/cgroup/system.slice/memory.max", "max\n"),
            ("/sys/fs/cgroup/system.slice/memory.current", "3000000000\n"),
            (&format!("{g}/memory.max"), "2147483648\n"),
            (&format!("{g}/memory.current"), "1073741824\n"),
        ]);
        assert_eq!(Cgroup::V2.headroom(&fs, groups, mounts), Some(1 << 30));
        assert_eq!(Cgroup::V1.headroom(&fs, groups, mounts), None);
        // Inactive page cache charged to the group is room; active pages (the weights in
        // use) are not, and a stat claiming more than the usage credits the usage alone.
        let mut fs = fs;
        fs.0.insert(
            format!("{g}/memory.stat").into(),
            "anon 800000000\nactive_file 100000000\ninactive_file 268435456\n".into(),
        );
        assert_eq!(
            Cgroup::V2.headroom(&fs, groups, mounts),
            Some((1 << 30) + (256 << 20))
        );
        fs.0.insert(
            format!("{g}/memory.stat").into(),
            "inactive_file 99999999999\n".into(),
        );
        assert_eq!(Cgroup::V2.headroom(&fs, groups, mounts), Some(2 << 30));
        // A container sees its own group as the mount's root.
        let inner =
            "30 23 0:26 /system.slice/node.service /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let fs = fake(&[
            ("/sys/fs/cgroup/memory.max", "2147483648\n"),
            ("/sys/fs/cgroup/memory.current", "1610612736\n"),
        ]);
        assert_eq!(Cgroup::V2.headroom(&fs, groups, inner), Some(512 << 20));
    }

    #[test]
    fn the_budget_is_the_smallest_source() {
        assert_eq!(smallest([Some(3), None, Some(2)]), Some(2));
        assert_eq!(smallest::<2>([None, None]), None);
        // --memory below everything else is the budget, less what this process holds.
        let b = budget(Some(64 << 20)).expect("a cap gives a budget");
        assert!(
            b <= 64 << 20 && b + crate::sys::rss_bytes() >= 64 << 20,
            "{b}"
        );
        assert!(check_memory_within(Some(64 << 20), "a KV cache", 128 << 20).is_err());
    }
}
